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


def speed_at_context(model, methods, *, context: int = 512, steps: int = 32, rounds: int = 3, token_ids=None) -> list:
    """Decode tokens/s of each method with ``context`` tokens already cached.

    The methods are timed in turn, ``rounds`` times over (so a slow moment of a shared machine
    hits every method alike), and each method's median round is reported.

    Returns
    -------
    list of (method, tokens_per_s, time_ratio_vs_first_method)
    """
    import statistics

    from arraykv import eval as ev

    ids = token_ids or ev.builtin_token_ids(model, context + steps)
    times: dict = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            cache = model.make_cache(m)
            model.prefill(ids[:context], cache)
            model.decode(ids[context], cache)  # warm-up (first decode may build kernels)
            t0 = time.perf_counter()
            for t in ids[context + 1 : context + steps]:
                model.decode(t, cache)
            times[m].append((time.perf_counter() - t0) / (steps - 1))
    med = {m: statistics.median(v) for m, v in times.items()}
    base = med[methods[0]]
    return [(m, 1.0 / med[m], med[m] / base) for m in methods]


def calibrated_rows(model, ids, prefill: int, exact) -> list:
    """``lowrank`` and ``vq`` (default options) with bases/codebooks fitted on tokens 600-1400 of the text.

    The evaluated tokens are the first ``len(ids)`` (≤ 600), so calibration and test do not overlap.
    """
    from arraykv import LowRank, VectorQuantization, eval as ev

    if len(ids) > 600:
        raise SystemExit("--calibrated needs --tokens <= 600 (tokens 600-1400 are the calibration text)")
    cal_ids = ev.builtin_token_ids(model, 1400)[600:]
    c = model.config
    geometry = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    rows = []
    for name, fitted in (
        ("lowrank", LowRank(rank=c.head_dim // 2)),
        ("vq", VectorQuantization(codebook_size=16, sub_dim=2)),
    ):
        cache = model.make_cache(name, calibration=ev.calibrate(model, cal_ids, fitted))
        run = ev.teacher_forced(model, ids, cache, prefill=prefill, method=f"{name} (calibrated)")
        rows.append(ev.compare(run, exact, ids[prefill + 1 :], **geometry))
    return rows


def main(argv=None) -> int:
    import arraykv
    from arraykv import eval as ev
    from arraykv.integrations.decoder.gguf_loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=None, help="default: every registered method, dense first")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="context of the speed table")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per method in the speed table")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the speed table (median reported)")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-quality", action="store_true", help="only the decode-speed table")
    ap.add_argument(
        "--calibrated",
        action="store_true",
        help="also run lowrank and vq with bases/codebooks fitted on another part of the text",
    )
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    methods = args.methods or ["dense"] + [m for m in arraykv.available_methods() if m != "dense"]
    model = load_model(args.model)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"arraykv {arraykv.__version__}; model {model.config.name}"
    )
    print(f"command: python benchmarks/quality.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    if not args.no_quality:
        ids = ev.builtin_token_ids(model, args.tokens)
        print(
            f"\n## Quality: {args.tokens} tokens, prefill {args.prefill}, "
            f"{args.tokens - args.prefill - 1} decode steps\n"
        )
        exact = ev.teacher_forced(model, ids, model.make_cache("dense"), prefill=args.prefill)
        rows = ev.evaluate(model, ids, methods, prefill=args.prefill, progress=sys.stderr.isatty(), exact=exact)
        if args.calibrated:
            rows += calibrated_rows(model, ids, args.prefill, exact)
        print(ev.format_table(rows))
    if not args.no_speed:
        print(
            f"\n## Decode speed with {args.context} tokens cached ({args.steps - 1} steps timed, "
            f"median of {args.rounds} interleaved rounds)\n"
        )
        print("| method | tokens/s | time per token vs dense |")
        print("|---|---|---|")
        order = ["dense"] + [m for m in methods if m != "dense"]
        for m, tps, ratio in speed_at_context(model, order, context=args.context, steps=args.steps, rounds=args.rounds):
            print(f"| {m} | {tps:.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
