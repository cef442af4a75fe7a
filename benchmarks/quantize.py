"""Quality and speed of the rotated quantizers and the pqo/pq/tq caches (CPU, NumPy + Numba).

Run: ``python benchmarks/quantize.py`` (add ``--quick`` for smaller sizes). Prints tables of
numbers measured in this run: Gaussian distortion against the Lloyd-Max optimum, stored bits
per value, adversarial inputs, keys with outlier channels, TurboQuant-prod bias and variance,
tq against pqo at equal bits, and quantize/dequantize throughput.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from functools import partial

import numpy as np

import arraykv
from arraykv import ops
from arraykv.quant import polar
from arraykv.quant.codebooks import lloyd_max, make_codebook
from arraykv.quant.qjl import make_sketch, prod_decode, prod_encode
from arraykv.quant.rotation import make_rotation

# the quantizers with the accelerated steps of the namespace
polar_encode = partial(polar.polar_encode, encode=ops.polar_encode)
polar_decode = partial(polar.polar_decode, decode=ops.polar_decode)

OPT128 = {2: 0.1160, 3: 0.03397, 4: 0.00932}


def rel_mse(x, y):
    return float(((x - y) ** 2).sum() / (x**2).sum())


def cos(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.mean(np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)))


def gaussian(rng, n):
    print("\n## Gaussian data, head_dim 128")
    print("| method | relative MSE | Lloyd-Max optimum | ratio | bits/value (codes + norm) | bits/value used_bytes() |")
    print("|---|---|---|---|---|---|")
    d = 128
    x = rng.standard_normal((1, 8, n, d)).astype(np.float32)
    for b in (2, 3, 4):
        rot, cb = make_rotation(d, 0, xp=np), make_codebook(b, d, xp=np)
        code = polar_encode(x, cb, rot)
        err = rel_mse(x, polar_decode(code, cb, rot))
        c = arraykv.make_cache(f"pqo{b}", num_layers=1, num_kv_heads=8, head_dim=d)
        c.prefill(0, x, x, x)
        c.prefill(0, x[:, :, :1], x[:, :, :1], x[:, :, :1])
        bpv = c.used_bytes() * 8 / (2 * 8 * (n + 1) * d)
        print(
            f"| pqo{b} | {err:.5f} | {OPT128[b]:.5f} | {err / OPT128[b]:.3f} | {code.bits_per_value:.3f} | {bpv:.3f} |"
        )


def adversarial(rng):
    print("\n## Adversarial inputs (fixed seed), relative MSE and ratio to Gaussian")
    d = 128
    cases = {
        "constant": np.ones((8, d), np.float32) * np.arange(1, 9, dtype=np.float32)[:, None],
        "one-hot": np.eye(d, dtype=np.float32),
        "sorted ramp": np.sort(rng.standard_normal((64, d)).astype(np.float32), axis=1),
        "linear ramp": np.tile(np.arange(d, dtype=np.float32), (4, 1)),
    }
    print("| bits | Gaussian | " + " | ".join(cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    g = rng.standard_normal((4000, d)).astype(np.float32)
    for b in (2, 3, 4):
        rot, cb = make_rotation(d, 0, xp=np), make_codebook(b, d, xp=np)
        eg = rel_mse(g, polar_decode(polar_encode(g, cb, rot), cb, rot))
        cells = []
        for x in cases.values():
            e = rel_mse(x, polar_decode(polar_encode(x, cb, rot), cb, rot))
            cells.append(f"{e:.4f} ({e / eg:.2f}×)")
        print(f"| {b} | {eg:.4f} | " + " | ".join(cells) + " |")


def outlier_keys(rng, t):
    print("\n## Keys with 4 outlier channels per head (×15), head_dim 128: attention-output cosine")
    b, h, g, d = 1, 4, 4, 128
    k = rng.standard_normal((b, h, t, d)).astype(np.float32)
    for hh in range(h):
        k[:, hh, :, rng.choice(d, 4, replace=False)] *= 15.0
    v = rng.standard_normal((b, h, t, d)).astype(np.float32)
    q = rng.standard_normal((b, h * g, t, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    qq = q[:, :, -64:]
    exact = arraykv.attention(qq, k, v, softmax_scale=scale)
    print(
        "| method | default (outlier channels auto, key weights) | rotation only (outliers=0, key_scale=False) "
        "| bits/value (default, no window, no sinks) |"
    )
    print("|---|---|---|---|")
    for m in ("pqo2", "pqo3", "pqo4", "tq3", "tq4"):
        row = []
        for opts in ({}, {"outliers": 0, "key_scale": False}):
            c = arraykv.make_cache(
                m, num_layers=1, num_kv_heads=h, head_dim=d, residual_window=0, sink_tokens=0, **opts
            )
            row.append(cos(_attend_last(c, q, k, v, 64, scale), exact))
            if not opts:
                bpv = c.used_bytes() * 8 / (2 * h * t * d)
        print(f"| {m} | {row[0]:.4f} | {row[1]:.4f} | {bpv:.3f} |")


def _attend_last(cache, q, k, v, n, scale):
    """Prefill all but the last ``n`` tokens, then those ``n`` with their queries; attend."""
    cache.prefill(0, k[:, :, :-n], v[:, :, :-n], q[:, :, :-n])
    r = cache.prefill(0, k[:, :, -n:], v[:, :, -n:], q[:, :, -n:])
    return arraykv.attention(q[:, :, -n:], r.k, r.v, softmax_scale=scale, logit_bias=r.logit_bias)


def tq_stats(rng, n):
    print(f"\n## TurboQuant-prod inner products, unit vectors, d = 128, {n} pairs (error = ⟨q, x̂⟩ − ⟨q, x⟩)")
    print("| bits | mean error | 3 standard errors | variance × d | REFERENCE variance × d |")
    print("|---|---|---|---|---|")
    d = 128
    ref = {2: 0.56, 3: 0.18, 4: 0.054}
    x = rng.standard_normal((n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = rng.standard_normal((n, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    x, q = x.astype(np.float32), q.astype(np.float32)
    rot, sk = make_rotation(d, 1, xp=np), make_sketch(d, 1, xp=np)
    for b in (2, 3, 4):
        cb = make_codebook(b - 1, d, xp=np)
        e = np.sum(q * prod_decode(prod_encode(x, cb, rot, sk), cb, rot, sk), 1).astype(float) - np.sum(q * x, 1)
        print(f"| {b} | {e.mean():+.2e} | {3 * e.std() / math.sqrt(n):.2e} | {e.var() * d:.4f} | {ref[b]} |")


def tq_vs_pqo(rng, t):
    print("\n## tq against pqo at equal key bits (values exact-ish: 8 bits), attention-output cosine")
    print("| data | keys 2 bits: tq2 (1+QJL) / pqo2 | keys 3 bits: tq3 / pqo3 | keys 4 bits: tq4 / pqo4 |")
    print("|---|---|---|---|")
    b, h, g, d = 1, 4, 4, 128
    scale = 1 / math.sqrt(d)
    for name in ("Gaussian", "outlier keys"):
        k = rng.standard_normal((b, h, t, d)).astype(np.float32)
        if name == "outlier keys":
            for hh in range(h):
                k[:, hh, :, rng.choice(d, 4, replace=False)] *= 15.0
        v = rng.standard_normal((b, h, t, d)).astype(np.float32)
        q = rng.standard_normal((b, h * g, t, d)).astype(np.float32) * 2.0
        qq = q[:, :, -64:]
        exact = arraykv.attention(qq, k, v, softmax_scale=scale)
        cells = []
        for bits in (2, 3, 4):
            out = []
            for m in (f"tq{bits}", f"pqo{bits}"):
                c = arraykv.make_cache(
                    m, num_layers=1, num_kv_heads=h, head_dim=d, residual_window=0, value_bits=8, softmax_scale=scale
                )
                out.append(cos(_attend_last(c, q, k, v, 64, scale), exact))
            cells.append(f"{out[0]:.4f} / {out[1]:.4f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def throughput(rng, shape, repeats):
    print(f"\n## Throughput, float32 {list(shape)}, head_dim {shape[-1]} (best of {repeats})")
    print("| bits | quantize M values/s | dequantize M values/s |")
    print("|---|---|---|")
    x = rng.standard_normal(shape).astype(np.float32)
    d = shape[-1]
    for b in (2, 3, 4):
        rot, cb = make_rotation(d, 0, xp=np), make_codebook(b, d, xp=np)
        code = polar_encode(x[:1, :64], cb, rot)  # compile
        polar_decode(code, cb, rot)
        te = td = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            code = polar_encode(x, cb, rot)
            t1 = time.perf_counter()
            polar_decode(code, cb, rot)
            t2 = time.perf_counter()
            te, td = min(te, t1 - t0), min(td, t2 - t1)
        print(f"| {b} | {x.size / te / 1e6:.0f} | {x.size / td / 1e6:.0f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, numpy {np.__version__}")
    lloyd_max(2, 128), lloyd_max(3, 128), lloyd_max(4, 128)
    gaussian(rng, 512 if args.quick else 4096)
    adversarial(rng)
    outlier_keys(rng, 512)
    tq_stats(rng, 20000 if args.quick else 100000)
    tq_vs_pqo(rng, 512)
    throughput(rng, (8, 512, 128) if args.quick else (8, 4096, 128), 3 if args.quick else 7)


if __name__ == "__main__":
    main()
