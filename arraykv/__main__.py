"""Command line: ``python -m arraykv demo``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import numpy as np

    import arraykv

    rng = np.random.default_rng(args.seed)
    layers, kv_heads, groups, head_dim = 2, 4, 2, 64
    scale = 1.0 / head_dim**0.5
    cfg = arraykv.AttendConfig(softmax_scale=scale, n_kv_groups=groups)
    print(f"{'method':<10}{'tokens':>8}{'KV bytes':>12}{'vs float16':>12}{'max |out - exact|':>20}")
    for method in args.methods:
        cache = arraykv.make_cache(method, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
        exact = arraykv.make_cache("dense", num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
        worst = 0.0
        for layer in range(layers):
            k = rng.standard_normal((1, kv_heads, args.prompt, head_dim), dtype=np.float32)
            v = rng.standard_normal((1, kv_heads, args.prompt, head_dim), dtype=np.float32)
            q = rng.standard_normal((1, kv_heads * groups, args.prompt, head_dim), dtype=np.float32)
            cache.prefill(layer, k, v, q)
            exact.prefill(layer, k, v, q)
            for _ in range(args.steps):
                k1, v1 = (rng.standard_normal((1, kv_heads, 1, head_dim), dtype=np.float32) for _ in range(2))
                q1 = rng.standard_normal((1, kv_heads * groups, 1, head_dim), dtype=np.float32)
                out = _attend(cache.decode(layer, k1, v1, q1, cfg), q1, scale)
                ref = _attend(exact.decode(layer, k1, v1, q1, cfg), q1, scale)
                worst = max(worst, float(np.max(np.abs(out - ref))))
        tokens = cache.seq_len(0)
        f16 = 2 * layers * kv_heads * tokens * head_dim * 2
        used = cache.memory_usage()
        print(f"{method:<10}{tokens:>8}{used:>12}{used / f16:>12.3f}{worst:>20.2e}")
    return 0


def _attend(out, q, scale):
    import arraykv

    if isinstance(out, arraykv.Fused):
        return out.output
    r = out.result
    return arraykv.attention(q, r.k, r.v, softmax_scale=scale, logit_bias=r.logit_bias)


def main(argv: list | None = None) -> int:
    """Entry point of ``python -m arraykv``."""
    parser = argparse.ArgumentParser(prog="arraykv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fill caches with prefill and decode steps and print what they hold")
    demo.add_argument("--methods", nargs="+", default=["dense"])
    demo.add_argument("--prompt", type=int, default=32)
    demo.add_argument("--steps", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
