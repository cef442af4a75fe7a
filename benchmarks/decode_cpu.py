"""Fused CPU decode attention from packed codes vs dense attention vs dequantize-then-attend.

Prints, for each mode and context, the time of one decode step (batch 1, 32 query heads,
8 KV heads, head_dim 128, float32 queries) on three paths measured side by side:

- ``fused``: attention straight from the packed codes (Numba kernel);
- ``dense``: ``arraykv.attention`` over uncompressed float32 K/V (the fastest NumPy form);
- ``deq+attn``: dequantize the whole cache, then the same dense attention (what a cache
  without a fused path does every step).

Numba's one-time compile (or cache load) is reported separately from steady state.

Usage: ``python benchmarks/decode_cpu.py [--contexts 1024 4096 ...] [--modes pqo4 ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import numpy as np

import arraykv
from arraykv.attention.polar_fused import polar_decode_attention
from arraykv.quant.polar import PolarCode, polar_decode

PER_TOKEN = ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers", "k_qjl", "k_qjl_norms")


def best_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def first_n(codec, n):
    """The codec state of the first ``n`` quantized tokens (views)."""
    cut = {name: getattr(codec, name)[:, :, :n, ...] for name in PER_TOKEN if getattr(codec, name) is not None}
    return dataclasses.replace(codec, n_quantized=n, **cut)


def dequantize(codec):
    """Float32 K/V of every token of ``codec`` (what a dequantizing cache builds each step)."""
    d = codec.rotation.dim
    k = polar_decode(PolarCode(codec.k_codes, codec.k_norms, codec.k_codebook.bits, d), codec.k_codebook, codec.rotation)
    v = polar_decode(PolarCode(codec.v_codes, codec.v_norms, codec.v_codebook.bits, d), codec.v_codebook, codec.rotation)
    if codec.k_outlier_idx is not None and codec.k_outlier_idx.shape[-1]:
        np.put_along_axis(k, np.broadcast_to(codec.k_outlier_idx[:, :, None, :], codec.k_outliers.shape).astype(np.int64),
                          codec.k_outliers.astype(np.float32), axis=-1)
    if getattr(codec, "k_scale", None) is not None:
        k = k / codec.k_scale.astype(np.float32)[:, :, None, :]
    if codec.k_mean is not None:
        k = k + codec.k_mean.astype(np.float32)[:, :, None, :]
        v = v + codec.v_mean.astype(np.float32)[:, :, None, :]
    return k, v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536])
    ap.add_argument("--modes", nargs="+", default=["pqo2", "pqo3", "pqo4", "tq3"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    b, hkv, g, d = 1, 8, 4, 128
    scale = d**-0.5
    top = max(args.contexts)
    rng = np.random.default_rng(args.seed)
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}")
    print(f"# shape: batch {b}, {hkv * g} query heads, {hkv} KV heads, head_dim {d}, float32 queries")
    k = rng.standard_normal((b, hkv, top, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, top, d), dtype=np.float32)
    q = rng.standard_normal((b, hkv * g, 1, d), dtype=np.float32)

    print("| mode | context | fused ms | dense ms | deq+attn ms | dense / fused | deq+attn / fused |")
    print("|---|---|---|---|---|---|---|")
    compile_ms = None
    for mode in args.modes:
        cache = arraykv.make_cache(mode, num_layers=1, num_kv_heads=hkv, head_dim=d, residual_window=0)
        chunk = 8192
        for s in range(0, top, chunk):
            cache.prefill(0, k[:, :, s:s + chunk], v[:, :, s:s + chunk], np.zeros((b, hkv * g, min(chunk, top - s), d), np.float32))
        full = cache.layer_codec_state(0)
        if compile_ms is None:
            t0 = time.perf_counter()
            polar_decode_attention(first_n(full, 64), q, scale)
            compile_ms = 1e3 * (time.perf_counter() - t0)
        for n in args.contexts:
            codec = first_n(full, n)
            kn, vn = k[:, :, :n], v[:, :, :n]
            t_fused = best_ms(lambda: polar_decode_attention(codec, q, scale), args.repeat)
            t_dense = best_ms(lambda: arraykv.attention(q, kn, vn, softmax_scale=scale), args.repeat)
            t_deq = best_ms(lambda: arraykv.attention(q, *dequantize(codec), softmax_scale=scale), max(1, args.repeat // 2))
            print(f"| {mode} | {n} | {t_fused:.2f} | {t_dense:.2f} | {t_deq:.2f} | {t_dense / t_fused:.2f} | {t_deq / t_fused:.1f} |")
    print(f"# first fused call (Numba compile or cache load): {compile_ms:.0f} ms")


if __name__ == "__main__":
    main()
