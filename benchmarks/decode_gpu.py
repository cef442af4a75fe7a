"""GPU decode step: fused PolarQuant attention vs dense float16 attention (needs CuPy + GPU).

Shape: batch 8, 32 query heads, 8 KV heads, head_dim 128; contexts 4k / 32k / 128k. Printed
side by side from one run, timed with CUDA events (median of ``--repeat`` calls, the L2 cache
flushed before each call so that a 4k cache is not served from L2):

- ``fused``: ``arraykv.ops.polar_decode_attention`` on CuPy (the ``kernels/polar.cu``
  launches: query preparation, split-K attention over the packed codes, merge with the
  float16 window), float16 queries;
- ``dense cupy``: float16 K/V, ``cupy.matmul`` (cuBLAS, float16 in, float32 softmax) with the
  query heads of a group stacked, so K/V are read once per KV head;
- ``dense sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the same float16
  K/V (``enable_gqa=True``, so K/V are not repeated) when PyTorch with CUDA is installed;
- ``floor``: bytes the fused step must read (codes, norms, outliers, QJL bits, float16
  window) ÷ the device-to-device copy bandwidth measured in the same run (bytes read + bytes
  written per second), and the achieved bandwidth on those bytes as a share of it;
  ``dense floor``: the float16 K/V bytes ÷ the same bandwidth;
- quantize throughput: the GPU quantizer (``arraykv.ops.polar_encode``) on the
  context's float16 keys, values per second.

With ``--rope`` the keys are those of a rotary model, so the cache fits a rotating key mean and
the step adds its share of every logit (one cuBLAS product per step, read by the kernel).

Usage: ``python benchmarks/decode_gpu.py [--contexts 4096 32768 131072] [--mode pqo4] [--rope]``
"""

from __future__ import annotations

import argparse
import json
import statistics


def cuda_ms(cp, fn, repeat=30, flush=None):
    """Median milliseconds of ``fn()`` between two CUDA events (after two warm-up calls)."""
    fn()
    fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        if flush is not None:
            flush.fill(1)  # evict the previous call's data from L2
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times), min(times)


def used_nbytes(codec) -> int:
    """Bytes a fused decode step reads: the in-use parts of the packed arrays and the window."""
    total = 0
    for name in (
        "k_codes",
        "k_norms",
        "v_codes",
        "v_norms",
        "k_outliers",
        "k_qjl",
        "k_qjl_norms",
        "k_window",
        "v_window",
    ):
        a = getattr(codec, name)
        if a is not None:
            total += int(a.size) * a.itemsize
    return total


def rope_keys(cp, rng, b, hkv, n, d, theta=10000.0):
    """Keys of a rotary model: a per-head mean plus noise, turned by each position (rotate-half pairs)."""
    mu = rng.standard_normal((b, hkv, 1, d), dtype=cp.float32) * 3.0
    k = mu + rng.standard_normal((b, hkv, n, d), dtype=cp.float32)
    ang = cp.arange(n, dtype=cp.float64)[:, None] * (theta ** (-2.0 * cp.arange(d // 2) / d))[None, :]
    c, s = cp.cos(ang).astype(cp.float32), cp.sin(ang).astype(cp.float32)
    a, bb = k[..., : d // 2], k[..., d // 2 :]
    return cp.concatenate([a * c - bb * s, bb * c + a * s], axis=-1).astype(cp.float16)


def build_cache(cp, mode, b, hkv, g, d, n, rng, rope=False):
    """A ``mode`` cache holding ``n`` random tokens; returns (cache, k16, v16)."""
    import arraykv

    if rope:
        k16 = rope_keys(cp, rng, b, hkv, n, d)
    else:
        k16 = rng.standard_normal((b, hkv, n, d), dtype=cp.float32).astype(cp.float16)
    v16 = rng.standard_normal((b, hkv, n, d), dtype=cp.float32).astype(cp.float16)
    cache = arraykv.make_cache(mode, num_layers=1, num_kv_heads=hkv, head_dim=d)
    first = min(n, 2048)  # calibration chunk, with its real queries
    q0 = rng.standard_normal((b, hkv * g, first, d), dtype=cp.float32).astype(cp.float16)
    cache.prefill(0, k16[:, :, :first], v16[:, :, :first], q0)
    if n > first:
        # later prefills use the queries only for their shape: a broadcast view costs nothing
        qv = cp.broadcast_to(q0[:, :, :1], (b, hkv * g, n - first, d))
        cache.prefill(0, k16[:, :, first:], v16[:, :, first:], qv)
    cp.get_default_memory_pool().free_all_blocks()
    return cache, k16, v16


def dense_cupy(cp, q16, k16, v16, scale):
    """Float16 decode attention with cuBLAS: (b, hq, 1, d) queries over (b, hkv, n, d) K/V."""
    b, hq, _, d = q16.shape
    hkv = k16.shape[1]
    qg = q16.reshape(b, hkv, hq // hkv, d)
    s = cp.matmul(qg, k16.transpose(0, 1, 3, 2)).astype(cp.float32) * scale  # (b, hkv, g, n)
    s = cp.exp(s - s.max(axis=-1, keepdims=True))
    p = (s / s.sum(axis=-1, keepdims=True)).astype(cp.float16)
    return cp.matmul(p, v16).reshape(b, hq, 1, d)


def main(argv=None):
    import cupy as cp

    from arraykv.attention.polar_fused import polar_decode_attention_reference
    from arraykv.ops import polar_decode_attention, polar_encode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--mode", default="pqo4")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the rows as JSON lines to this file")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also time the array-API path (what a step falls back to when the kernel declines it)",
    )
    ap.add_argument(
        "--rope",
        action="store_true",
        help="keys of a rotary model (the cache fits a rotating key mean, a logit term per token)",
    )
    args = ap.parse_args(argv)
    b, hkv, g, d = 8, 8, 4, 128
    scale = d**-0.5
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode()
    print(
        f"# GPU: {gpu}, {props['multiProcessorCount']} SMs, L2 {props['l2CacheSize'] / 2**20:.0f} MiB; "
        f"shape: batch {b}, {hkv * g} q heads, {hkv} kv heads, head_dim {d}, mode {args.mode}"
        f"{', rotary keys (rotating key mean)' if args.rope else ''}"
    )
    big = cp.empty(1 << 30, dtype=cp.uint8)
    big.fill(3)
    dst = cp.empty_like(big)
    copy_ms, _ = cuda_ms(cp, lambda: cp.copyto(dst, big), 20)
    bw = 2 * big.nbytes / (copy_ms * 1e-3)  # read + write
    print(f"# device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s (1 GiB copy, {copy_ms:.3f} ms)")
    big = dst = None  # the 2 GiB go before the timed runs
    flush = cp.empty(256 << 20, dtype=cp.uint8)
    try:
        import torch

        sdpa = torch.nn.functional.scaled_dot_product_attention if torch.cuda.is_available() else None
    except ImportError:
        sdpa = None
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((b, hkv * g, 1, d), dtype=cp.float32).astype(cp.float16)
    rows = []
    for n in args.contexts:
        cache, k16, v16 = build_cache(cp, args.mode, b, hkv, g, d, n, rng, args.rope)
        codec = cache.layer_codec_state(0)
        if args.rope and codec.k_mean_freq is None:
            raise SystemExit("--rope: the cache found no rotary convention in the keys")
        comp_bytes = used_nbytes(codec)
        dense_bytes = 2 * k16.nbytes
        if n <= 4096:  # the array-API reference materialises every token: check at small sizes only
            got = polar_decode_attention(codec, q, scale).astype(cp.float32)
            want = polar_decode_attention_reference(codec, q, scale).astype(cp.float32)
            err = float(cp.linalg.norm(got - want) / cp.linalg.norm(want))
            print(f"# n={n}: fused vs array-API reference, relative error {err:.2e}")
        t_fused, t_fused_min = cuda_ms(cp, lambda: polar_decode_attention(codec, q, scale), args.repeat, flush)

        def ten():
            for _ in range(10):
                polar_decode_attention(codec, q, scale)

        t_fused_tp = cuda_ms(cp, ten, max(3, args.repeat // 5), flush)[0] / 10  # launch gaps hidden
        # the other attention-kernel variant (next-tile prefetch on/off), for the record
        from arraykv.ops.cuda import polar as _cuda_polar

        default = _cuda_polar.PREFETCH
        _cuda_polar.PREFETCH = not default
        try:
            t_other, _ = cuda_ms(cp, lambda: polar_decode_attention(codec, q, scale), args.repeat, flush)
        finally:
            _cuda_polar.PREFETCH = default
        occ = {k[1]: v for k, v in _cuda_polar._OCCUPANCY.items()}
        print(
            f"# n={n}: prefetch={default}: {t_fused:.4f} ms, prefetch={not default}: {t_other:.4f} ms; "
            f"blocks per SM {occ}",
            flush=True,
        )
        if args.reference:
            t_ref, _ = cuda_ms(cp, lambda: polar_decode_attention_reference(codec, q, scale), 5, flush)
            print(f"# n={n}: array-API path {t_ref:.4f} ms ({t_ref / t_fused:.1f}x the fused step)", flush=True)
        t_dense, _ = cuda_ms(cp, lambda: dense_cupy(cp, q, k16, v16, scale), args.repeat, flush)
        t_sdpa = float("nan")
        if sdpa is not None:
            tq, tk, tv = (torch.as_tensor(a, device="cuda") for a in (q, k16, v16))
            try:
                sdpa(tq, tk, tv, scale=scale, enable_gqa=True)
                t_sdpa, _ = cuda_ms(cp, lambda: sdpa(tq, tk, tv, scale=scale, enable_gqa=True), args.repeat, flush)
            except TypeError:  # older PyTorch: repeat K/V per query head
                tk, tv = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)
                t_sdpa, _ = cuda_ms(cp, lambda: sdpa(tq, tk, tv, scale=scale), args.repeat, flush)
            del tq, tk, tv
        # quantize throughput on this context's keys (float16 in, packed codes + float16 norms out)
        t_quant, _ = cuda_ms(cp, lambda: polar_encode(k16, codec.k_codebook, codec.rotation), 10)
        quant_rate = k16.size / (t_quant * 1e-3)
        floor = comp_bytes / bw * 1e3
        row = dict(
            gpu=gpu,
            mode=args.mode,
            rope=args.rope,
            context=n,
            fused_ms=t_fused,
            fused_min_ms=t_fused_min,
            fused_back_to_back_ms=t_fused_tp,
            fused_other_variant_ms=t_other,
            floor_ms=floor,
            bw_share=floor / t_fused,
            dense_cupy_ms=t_dense,
            dense_sdpa_ms=t_sdpa,
            dense_floor_ms=dense_bytes / bw * 1e3,
            cupy_speedup=t_dense / t_fused,
            sdpa_speedup=t_sdpa / t_fused,
            quant_gvals=quant_rate / 1e9,
            comp_mb=comp_bytes / 1e6,
            copy_gbs=bw / 1e9,
        )
        rows.append(row)
        print("# " + json.dumps(row), flush=True)
        k16 = v16 = cache = codec = None  # freed before the next context is built
        cp.get_default_memory_pool().free_all_blocks()
    print()
    print(
        "| context | fused ms | floor ms | share of copy BW | dense cupy ms | dense sdpa ms | dense floor ms "
        "| cupy/fused | sdpa/fused | quantize G values/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['fused_ms']:.3f} | {r['floor_ms']:.3f} | {r['bw_share']:.0%} | "
            f"{r['dense_cupy_ms']:.3f} | {r['dense_sdpa_ms']:.3f} | {r['dense_floor_ms']:.3f} | "
            f"{r['cupy_speedup']:.2f} | {r['sdpa_speedup']:.2f} | {r['quant_gvals']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
