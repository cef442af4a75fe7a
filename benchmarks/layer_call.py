"""One layer's ``cache.decode`` at SmolLM2's geometry against NumPy attention over float K/V.

Usage::

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/layer_call.py [TOKENS] [METHODS]

``TOKENS`` (default 512) tokens are prefilled into one layer of 3 KV heads of head_dim 64,
then 300 decode steps of 9 query heads (GQA 3) are timed one call at a time; ``METHODS``
(comma-separated, default ``pqo4,pqo2,int4,dense``) are the caches compared. The baseline
writes the new token's K/V into preallocated float32 buffers and runs grouped attention with
``np.matmul`` and a softmax over them: what an uncompressed NumPy decoder pays per layer.

At short contexts a call is mostly fixed cost (argument checks, the undo record of a failed
call, the store of the token, the kernel's dispatch), so this is the measure of that overhead;
at long contexts the kernels' reading of the codes dominates. Each method runs ``--rounds``
rounds (default 5) of 300 steps, interleaved with the others; the time reported is the
median step of its fastest round (the first 50 steps of a round are not counted), which
damps the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import arraykv
from arraykv.protocol import AttendConfig

KV_HEADS, GROUPS, HEAD_DIM = 3, 3, 64
STEPS, SKIP = 300, 50


def _numpy_round(k, v, q, n, scale):
    """Median step time (s) of the NumPy baseline over one round."""
    h, g, d = KV_HEADS, GROUPS, HEAD_DIM
    buf_k = np.empty((1, h, n + STEPS, d), np.float32)
    buf_v = np.empty_like(buf_k)
    buf_k[:, :, :n] = k[:, :, :n]
    buf_v[:, :, :n] = v[:, :, :n]
    times = []
    for j in range(n, n + STEPS):
        t0 = time.perf_counter()
        buf_k[:, :, j] = k[:, :, j]
        buf_v[:, :, j] = v[:, :, j]
        qq = q[:, :, j : j + 1].reshape(1, h, g, d)
        s = np.matmul(qq, buf_k[:, :, : j + 1].swapaxes(-1, -2)) * scale
        s -= s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        np.matmul(p, buf_v[:, :, : j + 1]).reshape(1, h * g, 1, d)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[SKIP:]))


def _cache_round(method, k, v, q, n, cfg):
    """Median step time (s) of ``cache.decode`` of ``method`` over one round (a fresh cache)."""
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    cache.prefill(0, k[:, :, :n], v[:, :, :n], q[:, :, :n])
    times = []
    for j in range(n, n + STEPS):
        t0 = time.perf_counter()
        cache.decode(0, k[:, :, j : j + 1], v[:, :, j : j + 1], q[:, :, j : j + 1], cfg)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[SKIP:]))


def main() -> None:
    """Time the methods and print microseconds per call and the ratio to NumPy attention."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokens", nargs="?", type=int, default=512)
    ap.add_argument("methods", nargs="?", default="pqo4,pqo2,int4,dense")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, methods = args.tokens, args.methods.split(",")
    rng = np.random.default_rng(0)
    h, g, d = KV_HEADS, GROUPS, HEAD_DIM
    k = rng.standard_normal((1, h, n + STEPS, d), dtype=np.float32)
    v = rng.standard_normal((1, h, n + STEPS, d), dtype=np.float32)
    q = rng.standard_normal((1, h * g, n + STEPS, d), dtype=np.float32)
    cfg = AttendConfig(softmax_scale=d**-0.5, n_kv_groups=g)
    best = {m: np.inf for m in [*methods, "numpy"]}
    for _ in range(args.rounds):
        for m in methods:
            best[m] = min(best[m], _cache_round(m, k, v, q, n, cfg))
        best["numpy"] = min(best["numpy"], _numpy_round(k, v, q, n, cfg.softmax_scale))
    base = best["numpy"]
    print(f"{n} tokens, one layer ({h} KV heads, {h * g} query heads, head_dim {d}), us per call:")
    print(f"  {'numpy attention':16s} {base * 1e6:7.1f}")
    for m in methods:
        print(f"  {m:16s} {best[m] * 1e6:7.1f}   {best[m] / base:5.2f}x numpy")


if __name__ == "__main__":
    main()
