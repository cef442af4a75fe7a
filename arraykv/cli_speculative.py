"""``python -m arraykv speculative``: speculative decoding of SmolLM2-135M through a compressed cache.

Generates an answer twice from the same prompt and cache method: plain greedy decoding (one
``decode`` per token), then speculative decoding with a draft (``--draft``: ``ngram:N`` prompt
lookup, ``layers:N`` the model's first N layers, ``cache:METHOD`` the model over a cheaper
cache), and prints the text, the draft's acceptance, tokens per second of both, and whether
the two outputs are the same tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .cli_args import nonnegative_int, positive_int

__all__ = ["add_parser", "check", "run"]

_PROMPT = (
    "Repeat this list exactly, then repeat it once more: apples, pears, plums, figs, "
    "grapes, cherries, lemons, limes, melons, dates."
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "speculative",
        help="speculative decoding through a compressed cache, beside plain decoding",
        description=__doc__,
    )
    p.add_argument("--model", default=None, help="a .gguf file or a known model (default: smollm2-135m, fetched once)")
    p.add_argument("--prompt", default=_PROMPT, help="user message for the chat model")
    p.add_argument("--method", default="pqo4", help="the target's cache method")
    p.add_argument("--draft", default="ngram:3", help="ngram:N, layers:N or cache:METHOD")
    p.add_argument("-k", type=positive_int, default=4, help="tokens per verification pass")
    p.add_argument("--max-new-tokens", type=nonnegative_int, default=64)
    p.add_argument("--concurrent", action="store_true", help="draft in a second thread while the target verifies")
    p.set_defaults(run=run)


def check(args: argparse.Namespace) -> tuple:
    """Check every argument of ``speculative`` before the weights load.

    The target's method and a ``cache:METHOD`` draft's against the registry and against the
    tokens ``-k`` may take back (a cache of each is made on the model's geometry, which holds no
    tokens); then, from the model's header (:func:`~arraykv.cli_model.model_header`), a
    ``layers:N`` draft against the layer count and the prompt plus ``--max-new-tokens`` and the
    drafted tokens against the context length.

    Returns
    -------
    (draft, header)

    Raises
    ------
    UsageError
        An argument that cannot work, naming it.
    """
    from .caches import make_cache
    from .cli_checks import UsageError, check_methods
    from .cli_model import model_header
    from .integrations.decoder.drafts import CacheDraft, LayerDraft, draft_from_spec, require_truncate

    check_methods("--method", [args.method])
    try:
        draft = draft_from_spec(args.draft)
    except ValueError as exc:
        raise UsageError(f"--draft: {exc}") from None
    if isinstance(draft, CacheDraft):
        check_methods("--draft", [draft.method])
    depth = 2 * args.k - 1 if args.concurrent else args.k - 1  # as speculative_generate takes back
    header = model_header(args.model)
    if header.tokenizer is None:
        raise UsageError(f"--model: {header.path} has no tokenizer; speculative encodes --prompt")
    if isinstance(draft, LayerDraft) and draft.layers >= header.num_layers:
        raise UsageError(
            f"--draft: layers must be below the model's {header.num_layers} layers, received {draft.layers}"
        )
    geometry = dict(num_layers=header.num_layers, num_kv_heads=header.num_kv_heads, head_dim=header.head_dim)
    caches = [("--method", args.method)] + ([("--draft", draft.method)] if isinstance(draft, CacheDraft) else [])
    for flag, method in caches:
        try:
            require_truncate(make_cache(method, **geometry), f"the {method} cache", depth)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{flag}: {exc}") from None
    prompt = len(header.tokenizer.encode(header.tokenizer.chat_prompt(args.prompt)))
    if prompt + args.max_new_tokens + 2 * args.k > header.context_length:
        raise UsageError(
            f"--max-new-tokens: the prompt ({prompt} tokens) plus {args.max_new_tokens} new tokens and 2 x -k "
            f"drafted ones exceed the model's context length of {header.context_length}"
        )
    return draft, header


def run(args: argparse.Namespace, *, out: Callable[[str], object] = print) -> int:
    """Run ``speculative`` with parsed ``args``; ``out`` prints a line."""
    import time

    from .cli_model import load_model_of
    from .integrations.decoder.speculative import speculative_generate

    draft, header = check(args)
    model = load_model_of(header)
    ids = model.tokenizer.chat_prompt(args.prompt)
    stamps: list[float] = []
    plain = model.generate(
        ids,
        args.max_new_tokens,
        cache=model.make_cache(args.method),
        on_token=lambda _: stamps.append(time.perf_counter()),
    )
    plain_tps = (len(plain) - 1) / (stamps[-1] - stamps[0]) if len(plain) > 1 else 0.0
    r = speculative_generate(
        model,
        ids,
        args.max_new_tokens,
        cache=model.make_cache(args.method),
        draft=draft,
        k=args.k,
        concurrent=args.concurrent,
    )
    out(model.tokenizer.decode(r.tokens))
    out("")
    out(f"target cache {args.method}, draft {draft!r}, k={args.k}{', concurrent' if args.concurrent else ''}")
    out(f"acceptance {r.acceptance_rate:.0%} ({r.accepted} of {r.drafted} proposals, {r.rounds} passes)")
    speed = r.tokens_per_second
    out(
        f"decoding (prompt excluded): plain {plain_tps:.1f} tokens/s, speculative {speed:.1f} tokens/s"
        + (f" ({speed / plain_tps:.2f}x)" if plain_tps > 0 else "")
    )
    same = plain == r.tokens
    out(
        "same tokens as plain greedy decoding"
        if same
        else "differs from plain greedy decoding (a near-tie between the two best logits; see docs/speculative.md)"
    )
    return 0
