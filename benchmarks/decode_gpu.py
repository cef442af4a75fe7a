"""GPU decode step: fused PolarQuant attention vs dense float16 attention (needs CuPy + GPU).

Shape: batch 8, 32 query heads, 8 KV heads, head_dim 128; contexts 4k / 32k / 128k. Printed
side by side from one run, timed with CUDA events:

- ``fused pqo4``: ``kernels/polar.cu`` decode attention over the packed cache;
- ``dense cupy``: float16 K/V, ``arraykv.attention`` on CuPy (matmul + softmax + matmul);
- ``dense sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the same float16 K/V
  (when PyTorch with CUDA is installed);
- ``floor``: compressed bytes ÷ the device-to-device copy bandwidth measured in the same run,
  and the achieved bandwidth on the compressed bytes as a share of it;
- quantize throughput (values/s) of the GPU quantizer.

Usage: ``python benchmarks/decode_gpu.py [--contexts 4096 32768 131072]``
"""

from __future__ import annotations

import argparse

import numpy as np


def cuda_ms(cp, fn, repeat=20):
    fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop))
    return best


def main(argv=None):
    import cupy as cp

    import arraykv
    from arraykv.attention.polar_fused import polar_decode_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--mode", default="pqo4")
    args = ap.parse_args(argv)
    b, hkv, g, d = 8, 8, 4, 128
    scale = d**-0.5
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    print(f"# GPU: {props['name'].decode()}  shape: batch {b}, {hkv * g} q heads, {hkv} kv heads, head_dim {d}")
    big = cp.empty(1 << 30, dtype=cp.uint8)
    dst = cp.empty_like(big)
    copy_ms = cuda_ms(cp, lambda: cp.copyto(dst, big), 10)
    bw = 2 * big.nbytes / (copy_ms * 1e-3)  # read + write
    print(f"# device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s")
    del big, dst
    try:
        import torch
        sdpa = torch.nn.functional.scaled_dot_product_attention if torch.cuda.is_available() else None
    except ImportError:
        sdpa = None
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((b, hkv * g, 1, d), dtype=cp.float32)
    print("| context | fused ms | floor ms | share of copy BW | dense cupy ms | dense sdpa ms | cupy/fused | sdpa/fused | quantize Gvals/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.contexts:
        k = rng.standard_normal((b, hkv, n, d), dtype=cp.float32)
        v = rng.standard_normal((b, hkv, n, d), dtype=cp.float32)
        cache = arraykv.make_cache(args.mode, num_layers=1, num_kv_heads=hkv, head_dim=d, residual_window=0)
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record()
        cache.prefill(0, k, v, cp.zeros((b, hkv * g, n, d), cp.float32))
        t1.record()
        t1.synchronize()
        quant_rate = k.size * 2 / (cp.cuda.get_elapsed_time(t0, t1) * 1e-3)
        codec = cache.layer_codec_state(0)
        comp_bytes = sum(int(getattr(codec, a).nbytes) for a in ("k_codes", "k_norms", "v_codes", "v_norms"))
        t_fused = cuda_ms(cp, lambda: polar_decode_attention(codec, q, scale))
        k16, v16, q16 = k.astype(cp.float16), v.astype(cp.float16), q.astype(cp.float16)
        del k, v
        t_dense = cuda_ms(cp, lambda: arraykv.attention(q16, k16, v16, softmax_scale=scale))
        t_sdpa = float("nan")
        if sdpa is not None:
            tq, tk, tv = (torch.as_tensor(a, device="cuda") for a in (q16, k16, v16))
            tk, tv = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)
            t_sdpa = cuda_ms(cp, lambda: sdpa(tq, tk, tv, scale=scale))
        floor = comp_bytes / bw * 1e3
        print(f"| {n} | {t_fused:.3f} | {floor:.3f} | {floor / t_fused:.0%} | {t_dense:.3f} | {t_sdpa:.3f} | "
              f"{t_dense / t_fused:.2f} | {t_sdpa / t_fused:.2f} | {quant_rate / 1e9:.2f} |")
        del k16, v16, cache, codec
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
