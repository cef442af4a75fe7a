"""Quality and speed of the compressor methods and the int4/int8 caches.

Run: ``python benchmarks/compressor.py [--only speed]`` (prints Markdown tables; about a minute
on an idle 2-core machine).
All ratios in one table come from one run on the same data.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np

import arraykv
from arraykv import Hybrid, KVCacheCompressor, LowRank, ops
from arraykv.quant import vq
from arraykv.quant.intq import dequantize_groups, quantize_groups
from arraykv.quant.lowrank import eckart_young_error, fit_basis, project, reconstruct

train_vq = partial(vq.train_vq, assign=ops.vq_assign, update=ops.vq_update)
vq_encode = partial(vq.vq_encode, encode=ops.vq_encode)
vq_decode = partial(vq.vq_decode, decode=ops.vq_decode)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(((a - b) ** 2).sum() / (b**2).sum()))


def rel_mse(a, b):
    return rel_err(a, b) ** 2


def data(kind, rng, h=4, n=4096, d=128):
    if kind == "gaussian":
        return rng.standard_normal((h, n, d)).astype(np.float32)
    if kind == "low-rank + noise":
        u = rng.standard_normal((h, n, 16))
        w = rng.standard_normal((h, 16, d)) * 2
        return (u @ w + 0.5 * rng.standard_normal((h, n, d)) + rng.standard_normal((h, 1, d))).astype(np.float32)
    x = rng.standard_normal((h, n, d))
    x[:, :, [5, 33, 77, 120]] = x[:, :, [5, 33, 77, 120]] * 15 + 4  # outlier channels
    return x.astype(np.float32)


def table(title, header, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def lowrank(rng):
    rows = []
    for kind in ("gaussian", "low-rank + noise", "outlier channels"):
        x = data(kind, rng)
        for rank in (16, 32):
            b = fit_basis(x, rank=rank)
            ours = rel_err(reconstruct(project(x, b), b), x)
            ey = eckart_young_error(x, rank)
            xc = (x - x.mean(axis=1, keepdims=True)).astype(np.float64)
            sc = np.linalg.svd(xc, compute_uv=False)
            affine = float(np.sqrt((sc[:, rank:] ** 2).sum() / (x.astype(np.float64) ** 2).sum()))
            rows.append(
                [
                    kind,
                    str(rank),
                    f"{ours:.4f}",
                    f"{ey:.4f}",
                    f"{ours / ey:.4f}",
                    f"{affine:.4f}",
                    f"{ours / affine:.4f}",
                ]
            )
    table(
        "LowRank vs the Eckart–Young optimum (4 heads × 4096 tokens × 128)",
        [
            "data",
            "rank",
            "PCA rel. error",
            "truncated SVD (uncentred)",
            "ratio (≤ 1.01 required)",
            "truncated SVD of centred data + mean",
            "ratio",
        ],
        rows,
    )


def pq(rng):
    x = rng.standard_normal((2, 4096, 128)).astype(np.float32)
    t = time.perf_counter()
    cb = train_vq(x, codebook_size=256, sub_dim=8, max_iter=25)
    dt = time.perf_counter() - t
    train = rel_mse(vq_decode(vq_encode(x, cb), cb), x)
    y = rng.standard_normal((2, 4096, 128)).astype(np.float32)
    held = rel_mse(vq_decode(vq_encode(y, cb), cb), y)
    obj = np.array(cb.objective)
    mono = bool(np.all(np.diff(obj) <= 0))
    table(
        "Product quantization, 256 centroids per 8-dim sub-space, Gaussian head_dim 128 (1 bit/value of codes)",
        [
            "relative MSE (fitted on the data)",
            "relative MSE (held-out)",
            "1-bit Lloyd-Max scalar",
            "rate-distortion bound",
            "Lloyd iterations",
            "objective non-increasing",
            "train time (2 heads)",
        ],
        [[f"{train:.4f}", f"{held:.4f}", "0.3634", "0.25", str(cb.iterations), str(mono), f"{dt:.1f} s"]],
    )


def hybrid(rng):
    rows = []
    for kind in ("gaussian", "outlier channels"):
        x = data(kind, rng, h=8)[None]
        x[0, 1, 100, 7] = 60.0  # a single large value
        lr = KVCacheCompressor(LowRank(rank=32))
        lr_err = rel_mse(lr.decompress_kv(lr.compress_kv(x, x))[0], x)
        for bits in (4, 8):
            comp = KVCacheCompressor(Hybrid(rank=32, quant_bits=bits))
            c = comp.compress_kv(x, x)
            k2, _ = comp.decompress_kv(c)
            exact = bool(k2[0, 1, 100, 7] == 60.0)
            basis = sum(t.parts[n].nbytes for t in (c.k, c.v) for n in ("basis", "mean"))
            rows.append(
                [
                    kind,
                    f"INT{bits}",
                    f"{rel_mse(k2, x):.4f}",
                    f"{lr_err:.4f}",
                    f"{c.bits_per_value:.3f}",
                    f"{8 * (c.nbytes - basis) / (2 * x.size):.3f}",
                    str(c.k.meta["outliers"]),
                    str(exact),
                ]
            )
    table(
        "Hybrid rank 32 + INT4/INT8 (group 32 tokens per coefficient channel), [1, 8, 4096, 128]",
        [
            "data",
            "bits",
            "relative MSE",
            "rank-32 float MSE",
            "bits/value (all side tables)",
            "bits/value (without basis)",
            "outliers kept",
            "outlier exact",
        ],
        rows,
    )


def caches(rng):
    rows = []
    k = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    v = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    ko = k.copy()
    ko[..., [5, 33, 77, 120]] *= 15
    for kind, kk in (("gaussian", k), ("outlier key channels", ko)):
        for method, bits in (("int4", 4), ("int8", 8)):
            cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=8, head_dim=128)
            r = cache.prefill(0, kk, v, kk)
            base_k = dequantize_groups(quantize_groups(kk, bits, 32, param_dtype="float16"))
            base_v = dequantize_groups(quantize_groups(v, bits, 32, param_dtype="float16"))
            bpv = 8 * cache.used_bytes() / (2 * kk.size)
            rows.append(
                [
                    kind,
                    method,
                    f"{rel_mse(r.k, kk):.5f}",
                    f"{rel_mse(base_k, kk):.5f}",
                    f"{rel_mse(r.v, v):.5f}",
                    f"{rel_mse(base_v, v):.5f}",
                    f"{bpv:.3f}",
                ]
            )
    table(
        "int4/int8 caches (group 32, float16 scales) vs KIVI-style per-token quantization of both K and V",
        [
            "data",
            "cache",
            "K rel. MSE (cache)",
            "K rel. MSE (per-token)",
            "V rel. MSE (cache)",
            "V rel. MSE (per-token)",
            "bits/value held",
        ],
        rows,
    )


def best_of(fn, n=5):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), sorted(ts)[len(ts) // 2]


def speed(rng):
    x = rng.standard_normal((8, 4096, 128)).astype(np.float32)
    y = rng.standard_normal((8, 4096, 128)).astype(np.float32)
    vals = x.size + y.size
    rows = []
    for bits in (8, 4):
        comp = KVCacheCompressor(Hybrid(rank=32, quant_bits=bits))
        best, med = best_of(lambda: comp.compress_kv_3d(x, y))
        rows.append(
            [f"Hybrid INT{bits} compress, basis fitted per call", f"{vals / best / 1e6:.0f}", f"{vals / med / 1e6:.0f}"]
        )
        comp.fit(x, y)
        best, med = best_of(lambda: comp.compress_kv_3d(x, y))
        rows.append(
            [f"Hybrid INT{bits} compress, basis fitted once", f"{vals / best / 1e6:.0f}", f"{vals / med / 1e6:.0f}"]
        )
        c = comp.compress_kv_3d(x, y)
        best, med = best_of(lambda: comp.decompress_kv(c))
        rows.append([f"Hybrid INT{bits} decompress", f"{vals / best / 1e6:.0f}", f"{vals / med / 1e6:.0f}"])
    flat = x.reshape(-1, 128)
    best, med = best_of(
        lambda: quantize_groups(flat, 8, 32, group_minmax=ops.intq_group_minmax, quantize_pack=ops.intq_quantize_pack)
    )
    rows.append(
        ["group-wise INT8 quantize + pack alone (Numba)", f"{x.size / best / 1e6:.0f}", f"{x.size / med / 1e6:.0f}"]
    )
    table(
        "Throughput on [8, 4096, 128] float32 K and V (M values/s; values = K + V)",
        ["operation", "best of 5", "median of 5"],
        rows,
    )


def fitted_decode(rng):
    """One decode step of the ``lowrank``/``vq`` caches, fused vs dequantized vs the dense cache.

    SmolLM2-135M's layer shape (batch 1, 3 KV heads, 9 query heads, head_dim 64), default options
    (rank 32 / 16 centroids per 2-dim sub-space, 20-token window, 4 sinks), fitted on the prefill.
    Each cell times ``cache.decode`` plus, for ``Dequantized`` results, the attention the caller
    runs; the paths are interleaved (one step of each per round) and the median of the rounds is
    reported. The caches are rebuilt for each context so every path sees the same tokens.
    """
    h, g, d = 3, 3, 64
    cfg = arraykv.AttendConfig(d**-0.5, g)
    rows = []
    for ctx in (512, 4096):
        k = rng.standard_normal((1, h, ctx, d)).astype(np.float32)
        v = rng.standard_normal((1, h, ctx, d)).astype(np.float32)
        q0 = rng.standard_normal((1, h * g, ctx, d)).astype(np.float32)
        steps = [
            (
                rng.standard_normal((1, h, 1, d)).astype(np.float32),
                rng.standard_normal((1, h * g, 1, d)).astype(np.float32),
            )
            for _ in range(64)
        ]
        paths = {"dense": arraykv.make_cache("dense", num_layers=1, num_kv_heads=h, head_dim=d)}
        for method in ("lowrank", "vq"):
            for path in ("fused", "dequantized"):
                paths[f"{method} {path}"] = arraykv.make_cache(
                    method, num_layers=1, num_kv_heads=h, head_dim=d, decode_path=path
                )
        for cache in paths.values():
            cache.prefill(0, k, v, q0)
        times = {n: [] for n in paths}
        for i, (k1, q1) in enumerate(steps):
            for name, cache in paths.items():
                t = time.perf_counter()
                out = cache.decode(0, k1, k1, q1, cfg)
                if isinstance(out, arraykv.Dequantized):
                    arraykv.attention(q1, out.result.k, out.result.v, softmax_scale=cfg.softmax_scale)
                if i >= 4:  # the first steps compile / warm up
                    times[name].append(time.perf_counter() - t)
        med = {n: sorted(ts)[len(ts) // 2] * 1e6 for n, ts in times.items()}
        for name in paths:
            rows.append([str(ctx), name, f"{med[name]:.0f}", f"{med[name] / med['dense']:.2f}x"])
    table(
        "lowrank / vq decode step at the SmolLM2 layer shape (µs, median of 60 interleaved steps)",
        ["context", "path", "µs per step", "vs dense cache"],
        rows,
    )


def main(argv=None):
    import argparse

    parts = {
        "lowrank": lowrank,
        "pq": pq,
        "hybrid": hybrid,
        "caches": caches,
        "speed": speed,
        "fitted_decode": fitted_decode,
    }
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", choices=sorted(parts), action="append", help="run only these sections")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for name, fn in parts.items():
        if not args.only or name in args.only:
            fn(rng)


if __name__ == "__main__":
    main()
