"""``python -m arraykv longctx``: cache methods at long context (needle retrieval and long-text KL).

Prints, as Markdown, the needle-retrieval grid (:func:`arraykv.eval.needle_grid`: a pass key
hidden at several depths of 2k-8k tokens of filler) and the teacher-forced quality after long
prefixes (:func:`arraykv.eval.long_text_quality`: KL, top-1, perplexity change and bits/value at
each prefix length), then the wall time and the peak memory; ``--plot`` saves a PNG of both.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable

from .cli_args import fraction, nonnegative_int, positive_int
from .cli_checks import UsageError, check_distinct, check_methods, check_output_file, refuse_with

__all__ = ["add_parser", "add_arguments", "check", "run", "DEFAULT_METHODS"]

#: Methods of the default run (those registered).
DEFAULT_METHODS = ("dense", "pqo4", "pqo3", "pqo2", "int8", "int4")

#: The needle grid's options and their defaults (given with ``--no-needle``: refused).
NEEDLE_DEFAULTS = {"lengths": [2048, 4096, 8192], "depths": [0.1, 0.5, 0.9], "haystack": "filler", "seed": 0}
#: The long-text table's options and their defaults (given with ``--no-kl``: refused).
KL_DEFAULTS = {"prefix_lengths": [3840, 7936], "text": "book", "positions": 256}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("longctx", help="needle retrieval and KL of cache methods at 2k-8k tokens", description=__doc__)
    add_arguments(p)
    p.set_defaults(run=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``longctx`` (shared with ``benchmarks/long_context.py``)."""
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file (llama, qwen2, qwen3, gemma3) or a known model: smollm2-135m, "
        "gemma3-270m (fetched once; default: smollm2-135m)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="cache methods (default: dense, pqo4, pqo3, pqo2, int8, int4); dense is always run",
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        type=positive_int,
        default=None,
        help="needle context lengths in tokens (prompt + question; default 2048 4096 8192)",
    )
    p.add_argument(
        "--depths", nargs="+", type=fraction, default=None, help="needle depths in [0, 1] (default 0.1 0.5 0.9)"
    )
    p.add_argument(
        "--haystack",
        default=None,
        help="filler text: 'filler' (default: the classic grass/sky/sun lines), 'book' (the shipped novel) or any text",
    )
    p.add_argument("--seed", type=nonnegative_int, default=None, help="seed of the pass keys (default 0)")
    p.add_argument(
        "--prefix-lengths",
        nargs="+",
        type=positive_int,
        default=None,
        help="long-text prefix lengths (default 3840 7936; each + --positions must fit the context)",
    )
    p.add_argument(
        "--text",
        default=None,
        help="long text of the KL table: 'book' (default: the shipped novel, about 10k tokens), 'pydoc' (the "
        "Python language reference topics the interpreter ships, over 100k tokens: for prefixes "
        "beyond 9k) or the path of a UTF-8 file",
    )
    p.add_argument(
        "--positions", type=positive_int, default=None, help="decoded positions scored after each prefix (default 256)"
    )
    p.add_argument("--chunk-size", type=positive_int, default=512, help="tokens per prefill chunk")
    p.add_argument(
        "--prefill-mode",
        choices=["cache", "exact", "cache-chunks"],
        default="cache",
        help="cache (default, the path users run): the model's chunked prefill with each method's "
        "cache; exact: every method starts from one exact prefill; cache-chunks: chunked "
        "prefill storing each chunk compressed as it comes",
    )
    p.add_argument("--plot", default=None, metavar="PATH", help="save a PNG of the grids and the KL curve")
    p.add_argument("--no-needle", action="store_true", help="skip the needle grid")
    p.add_argument("--no-kl", action="store_true", help="skip the long-text quality table")
    p.add_argument("--trace-memory", action="store_true", help="also report the tracemalloc peak of the run (slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check(args: argparse.Namespace) -> tuple:
    """Check every argument of ``longctx`` before the weights load; fill in the defaults.

    Values against each other and the file system first; then, from the model's header
    (:func:`~arraykv.cli_model.model_header`), lengths against its context length, every needle
    cell against the room its intro, needle and question take in the model's tokens, and the
    long text against the tokens the prefixes need. Options of a part that does not run
    (``--no-needle``, ``--no-kl``) are refused.

    Returns
    -------
    (methods, task, text, label, header)
        ``task`` None with ``--no-needle``; ``text`` and ``label`` None with ``--no-kl``.

    Raises
    ------
    UsageError
        An argument that cannot work, naming it.
    ImportError
        ``--plot`` without matplotlib.
    """
    from . import eval as ev
    from .caches import available_methods
    from .cli_model import model_header
    from .eval.texts import long_text_by_name

    if args.no_needle and args.no_kl:
        raise UsageError("--no-needle and --no-kl leave nothing to run")
    for skipped, defaults, mode in (
        (args.no_needle, NEEDLE_DEFAULTS, "--no-needle"),
        (args.no_kl, KL_DEFAULTS, "--no-kl"),
    ):
        if skipped:
            refuse_with({"--" + k.replace("_", "-"): getattr(args, k) for k in defaults}, mode)
        for k, v in defaults.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    have = available_methods()
    methods = check_methods("--methods", args.methods) if args.methods else [m for m in DEFAULT_METHODS if m in have]
    for flag in ("lengths", "depths", "prefix_lengths"):
        check_distinct("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ImportError('--plot needs matplotlib: pip install "arraykv[plot]"') from exc
        check_output_file("--plot", args.plot)
        ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        if ext and ext not in kinds:
            raise UsageError(f"--plot: matplotlib cannot write .{ext} files; use one of {', '.join(sorted(kinds))}")
    text = label = task = None
    if not args.no_kl:
        try:
            text, label = long_text_by_name(args.text)
        except ValueError as exc:
            raise UsageError(f"--text: {exc}") from None
    if not args.no_needle:
        if not args.haystack.strip():
            raise UsageError("--haystack: the filler text is empty")
        haystack = ev.FILLER if args.haystack == "filler" else args.haystack
        task = ev.NeedleTask(haystack=haystack, seed=args.seed)
    header = model_header(args.model, quiet=args.no_progress)
    if header.tokenizer is None:
        raise UsageError(f"--model: {header.path} has no tokenizer; longctx works on text")
    limit = header.context_length
    if task is not None:
        over = [n for n in args.lengths if n > limit]
        if over:
            raise UsageError(f"--lengths: {over} exceed the model's context length of {limit}")
        try:
            for n in args.lengths:  # the prompts needle_grid builds, each once
                for d in args.depths:
                    p = task.build(header.tokenizer, n, d)
                    room = max(task.answer_tokens, len(p.target_ids)) - 1
                    if n + room > limit:
                        task.build(header.tokenizer, n, d, total=limit - room)
        except ValueError as exc:
            raise UsageError(f"--lengths: {exc}") from None
    if text is not None:
        over = [p for p in args.prefix_lengths if p + args.positions > limit]
        if over:
            raise UsageError(
                f"--prefix-lengths: {over} plus --positions {args.positions} exceed the model's context length "
                f"of {limit}"
            )
        need = max(args.prefix_lengths) + args.positions + 1
        got = len(header.tokenizer.encode(text))
        if got < need:
            raise UsageError(
                f"--text: {label} has {got} tokens of this model; the longest prefix plus --positions needs {need}"
            )
    return methods, task, text, label, header


def run(args: argparse.Namespace, *, out: Callable[[str], None] = print) -> int:
    """Run ``longctx`` with parsed ``args``; ``out`` prints a line."""
    from . import __version__, eval as ev
    from .cli_model import load_model_of
    from .eval.texts import text_token_ids

    methods, task, text, label, header = check(args)
    progress = not args.no_progress and sys.stderr.isatty()

    model = load_model_of(header, quiet=args.no_progress)
    if model.tokenizer is None:
        raise ValueError("this GGUF file has no tokenizer; longctx needs one")
    c = model.config
    out(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"arraykv {__version__}; model {c.name} ({c.num_layers} layers, {c.num_kv_heads} KV heads, "
        f"head_dim {c.head_dim}, context {c.context_length})"
    )
    out(f"prefill: {args.prefill_mode}, chunks of {args.chunk_size} tokens")
    if args.trace_memory:
        import tracemalloc

        tracemalloc.start()
    t0 = time.perf_counter()
    grid = kl = None
    if not args.no_needle:
        grid = ev.needle_grid(
            model,
            methods,
            lengths=args.lengths,
            depths=args.depths,
            task=task,
            chunk_size=args.chunk_size,
            prefill_mode=args.prefill_mode,
            progress=progress,
            on_row=lambda row: out(
                f"  measured {row.method} at {row.length} tokens, depth {row.depth:.0%}: "
                f"{'retrieved' if row.retrieved else 'missed'}, log p(key) {row.key_logprob:.2f}, "
                f"{row.bits_per_value:.2f} bits/value ({time.perf_counter() - t0:.0f} s)"
            ),
        )
        kind = {"book": "the book", "filler": "filler"}.get(args.haystack, "custom")
        out(
            f"\n## Needle retrieval ({kind} haystack, "
            f"{task.key_digits}-digit keys, {task.answer_tokens} greedy answer tokens)\n"
        )
        out(grid.format_grid())
        out(
            "\n✓ retrieved / ✗ missed, then log p(key) in nats (teacher-forced); in parentheses where the "
            "exact cache missed (not counted in 'where exact')."
        )
    if not args.no_kl:
        need = max(args.prefix_lengths) + args.positions + 1
        token_ids = text_token_ids(model, need, lambda: text, label)
        kl = ev.long_text_quality(
            model,
            methods,
            prefix_lengths=args.prefix_lengths,
            positions=args.positions,
            token_ids=token_ids,
            chunk_size=args.chunk_size,
            prefill_mode=args.prefill_mode,
            progress=progress,
            on_row=lambda p, row: out(
                f"  measured {row.method} after {p} tokens: {row.bits_per_value:.2f} bits/value, mean KL "
                f"{row.mean_kl:.4g}, top-1 {row.top1_agreement:.1%} ({time.perf_counter() - t0:.0f} s)"
            ),
        )
        out(f"\n## Long-text quality ({args.positions} teacher-forced positions after each prefix, {label})\n")
        out(kl.format_table())
        out(
            "\nbits/value = used_bytes() * 8 / (2 * layers * kv_heads * tokens * head_dim) with prefix + "
            "positions tokens held (a sliding-window layer: the tokens of its window); dense holds float32."
        )
    wall = time.perf_counter() - t0
    out(f"\nwall time: {wall:.1f} s")
    peak = _max_rss_mib()
    line = "peak memory: " + (f"max RSS {peak:.0f} MiB" if peak is not None else "max RSS unavailable")
    if args.trace_memory:
        import tracemalloc

        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        line += f", tracemalloc peak of the run {traced / 2**20:.0f} MiB"
    out(line)
    if args.plot:
        ev.plot_long_context(args.plot, needle=grid, long_text=kl, title=f"{c.name}: long-context quality")
        out(f"plot: {args.plot}")
    return 0


def _max_rss_mib() -> float | None:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in MiB (None where the resource module is missing)."""
    try:
        import resource
    except ImportError:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024
