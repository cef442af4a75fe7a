"""Command line: ``python -m arraykv {demo,bench,inspect,longctx,speculative,store}``.

``demo``
    Fetch SmolLM2-135M if needed, generate text through a compressed cache, and print a quality
    table (bits/value, KV bytes vs float16, perplexity change, top-1 agreement, tokens/s) for
    dense and the main compressed methods (pqo4/3/2, int8/int4; `--methods` for others).
``bench``
    Run the benchmark scripts of a source checkout (``benchmarks/*.py``) and print their tables.
``inspect``
    Follow one vector through every stage of a PolarQuant cache and save plots.
``longctx``
    Needle retrieval over 2k-8k tokens and the KL after long prefixes, per cache method, as
    Markdown tables (``--plot`` saves a PNG).
``speculative``
    Speculative decoding through a compressed cache beside plain greedy decoding: the text,
    the draft's acceptance and both speeds.
``store``
    A prefix store's entries (tokens, bytes, ages) and total, eviction, removal (``docs/store.md``).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m arraykv`` (and the ``arraykv`` console script)."""
    from . import cli_bench, cli_demo, cli_longctx, cli_speculative, cli_store, inspect_pqo

    parser = argparse.ArgumentParser(prog="arraykv", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in (cli_demo, cli_bench, inspect_pqo, cli_longctx, cli_speculative, cli_store):
        mod.add_parser(sub)
    args = parser.parse_args(argv)
    from .compile_notice import compile_notice

    try:
        with compile_notice():
            return int(args.run(args) or 0)
    except (ImportError, OSError, ValueError, RuntimeError) as exc:  # OSError: a missing file, a directory
        print(f"arraykv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
