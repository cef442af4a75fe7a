"""``python -m arraykv demo``: a real model decoding through compressed KV caches."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .cli_args import positive_int
from .cli_checks import UsageError, check_methods
from .integrations.common.generation import stop_tokens, tokenizer_stops

__all__ = ["add_parser", "check", "run", "default_methods"]

_PREFERRED = ("dense", "pqo4", "pqo3", "pqo2", "int8", "int4")


def default_methods() -> list:
    """``dense`` plus those of pqo4/pqo3/pqo2/int8/int4 that are registered."""
    from .caches import available_methods

    have = set(available_methods())
    return [m for m in _PREFERRED if m in have]


#: The demo's user message.
DEFAULT_PROMPT = "Write one sentence about the sea."


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="generate with SmolLM2-135M through a compressed cache and print a quality table",
        description=__doc__,
    )
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file (llama, qwen2, qwen3, gemma3) or a known model: smollm2-135m, "
        "gemma3-270m (fetched once; default: smollm2-135m)",
    )
    p.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="user message for a chat model; text to continue for a base model"
    )
    p.add_argument("--generate-with", default=None, help="cache method for the generation (default: pqo4, else dense)")
    p.add_argument("--max-new-tokens", type=positive_int, default=40)
    p.add_argument("--methods", nargs="+", default=None, help="methods in the table (default: dense, pqo*, int*)")
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=256,
        help="tokens of the built-in text for the table (512 in docs/quality.md)",
    )
    p.add_argument("--prefill", type=positive_int, default=64)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def check(args: argparse.Namespace) -> tuple:
    """Check every argument of ``demo`` before the weights load (:mod:`arraykv.cli_checks`).

    The values first, then the model's header (:func:`~arraykv.cli_model.model_header`: context
    length, tokenizer, the built-in text's length in its tokens).

    Returns
    -------
    (methods, generate_with, header)
        The table's methods, the generation's method and the model's header.

    Raises
    ------
    UsageError
        An argument that cannot work, naming it.
    """
    from .caches import available_methods
    from .cli_model import model_header
    from .eval.texts import builtin_text

    methods = check_methods("--methods", args.methods) if args.methods else default_methods()
    if args.generate_with is not None:
        check_methods("--generate-with", [args.generate_with])
    gen = args.generate_with or ("pqo4" if "pqo4" in available_methods() else "dense")
    if args.prefill + 2 > args.tokens:
        raise UsageError(
            f"--prefill: the table prefills --prefill tokens and scores at least one decoded after them, so "
            f"--tokens must be at least --prefill + 2 = {args.prefill + 2}; received --tokens {args.tokens}"
        )
    header = model_header(args.model)
    if header.tokenizer is None:
        raise UsageError(f"--model: {header.path} has no tokenizer; the demo needs one")
    limit = header.context_length
    if args.tokens > limit:
        raise UsageError(f"--tokens: {args.tokens} exceeds the model's context length of {limit}")
    have = len(header.tokenizer.encode(builtin_text()))
    if args.tokens > have:
        raise UsageError(f"--tokens: the built-in text has {have} tokens of this model, fewer than {args.tokens}")
    prompt = len(header.tokenizer.encode(_prompt_text(header.tokenizer, args.prompt)))
    if prompt == 0:
        raise UsageError("--prompt: the text is empty, and this base model has nothing to continue")
    if prompt + args.max_new_tokens > limit:
        raise UsageError(
            f"--max-new-tokens: the prompt ({prompt} tokens) plus {args.max_new_tokens} new tokens exceed the "
            f"model's context length of {limit}"
        )
    return methods, gen, header


def _prompt_text(tokenizer: Any, prompt: str) -> str:
    """The text generated from: the chat form for an instruction-tuned model, else the prompt."""
    if tokenizer.chat_template is not None:
        return str(tokenizer.chat_prompt(prompt))
    return prompt if prompt != DEFAULT_PROMPT else "Here is one sentence about the sea:"


def run(args: argparse.Namespace) -> int:
    from . import eval as ev
    from .cli_model import load_model_of

    methods, gen, header = check(args)
    print(f"Loading the model ({args.model or 'SmolLM2-135M-Instruct'}, float32 NumPy weights)...", flush=True)
    t0 = time.perf_counter()
    model = load_model_of(header)
    print(f"  {model!r} in {time.perf_counter() - t0:.1f} s\n")

    prompt = _prompt_text(model.tokenizer, args.prompt)
    if model.tokenizer.chat_template is not None:  # an instruction-tuned model: its chat form
        print(f"[{gen} cache] user: {args.prompt}\nassistant: ", end="", flush=True)
    else:  # a base model (no chat template in the file) continues text
        print(f"[{gen} cache] (a base model: the text is continued)\n{prompt}", end="", flush=True)
    cache = model.make_cache(gen)
    pieces: list = []
    stops = stop_tokens(tokenizer_stops(model.tokenizer))

    def show(tok: int) -> None:
        if tok in stops:
            return
        pieces.append(tok)
        text = model.tokenizer.decode(pieces)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text, end="", flush=True)
            pieces.clear()

    t0 = time.perf_counter()
    new = model.generate(prompt, args.max_new_tokens, cache=cache, on_token=show)
    dt = time.perf_counter() - t0
    print(
        f"\n  ({len(new)} tokens in {dt:.1f} s, prompt included; KV cache {cache.memory_usage() / 1024:.0f} KiB "
        f"for {cache.seq_len(0)} tokens)\n"
    )

    ids = ev.builtin_token_ids(model, args.tokens)
    print(
        f"Teacher-forced quality on {args.tokens} tokens of Pride and Prejudice (prefill {args.prefill}, "
        f"then {args.tokens - args.prefill - 1} decode steps per method):",
        flush=True,
    )
    rows = ev.evaluate(model, ids, methods, prefill=args.prefill, progress=not args.no_progress)
    print(ev.format_table(rows, markdown=False))
    print("\nbits/value = used_bytes() * 8 / (2 * layers * kv_heads * tokens * head_dim); dense holds float32.")
    print("KV vs f16 = bytes held / float16 K/V of the same tokens. Full table: python benchmarks/quality.py")
    sys.stdout.flush()
    return 0
