"""Quality and decode speed of every registered cache method on SmolLM2-135M.

Two tables, both measured in this run:

1. teacher-forced quality (:func:`arraykv.eval.evaluate`): the first ``--tokens`` tokens of the
   shipped text (Pride and Prejudice, ch. 1-2), ``--prefill`` through ``cache.prefill``, the rest
   decoded one by one; perplexity and its change, mean KL(exact || method), top-1 agreement,
   bits/value, KV bytes vs float16, decode tokens/s;
2. decode speed at a fixed context: prefill ``--context`` tokens, then time ``--steps`` decode
   steps; tokens/s and time per token relative to the dense cache.

Run from the repository root::

    python benchmarks/quality.py                    # all registered methods, 512 tokens
    python benchmarks/quality.py --methods dense pqo4 --tokens 256
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def speed_at_context(model, methods, *, context: int = 512, steps: int = 32, token_ids=None) -> list:
    """Decode tokens/s of each method with ``context`` tokens already cached.

    Returns
    -------
    list of (method, tokens_per_s, time_ratio_vs_first_method)
    """
    from arraykv import eval as ev

    ids = token_ids or ev.builtin_token_ids(model, context + steps)
    rows = []
    for m in methods:
        cache = model.make_cache(m)
        model.prefill(ids[:context], cache)
        model.decode(ids[context], cache)  # warm-up (first decode may build kernels)
        t0 = time.perf_counter()
        for t in ids[context + 1: context + steps]:
            model.decode(t, cache)
        rows.append((m, (steps - 1) / (time.perf_counter() - t0)))
    base = rows[0][1]
    return [(m, tps, base / tps) for m, tps in rows]


def main(argv=None) -> int:
    import arraykv
    from arraykv import eval as ev
    from arraykv.integrations.gguf_llama import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=None, help="default: every registered method, dense first")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="context of the speed table")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per method in the speed table")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    methods = args.methods or ["dense"] + [m for m in arraykv.available_methods() if m != "dense"]
    model = load_model(args.model)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"arraykv {arraykv.__version__}; model {model.config.name}")
    print(f"command: python benchmarks/quality.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    ids = ev.builtin_token_ids(model, args.tokens)
    print(f"\n## Quality: {args.tokens} tokens, prefill {args.prefill}, {args.tokens - args.prefill - 1} decode steps\n")
    rows = ev.evaluate(model, ids, methods, prefill=args.prefill, progress=sys.stderr.isatty())
    print(ev.format_table(rows))
    if not args.no_speed:
        print(f"\n## Decode speed with {args.context} tokens cached ({args.steps - 1} steps timed)\n")
        print("| method | tokens/s | time per token vs dense |")
        print("|---|---|---|")
        order = ["dense"] + [m for m in methods if m != "dense"]
        for m, tps, ratio in speed_at_context(model, order, context=args.context, steps=args.steps):
            print(f"| {m} | {tps:.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
