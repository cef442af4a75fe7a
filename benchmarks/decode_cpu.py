"""Fused CPU decode attention from packed codes vs dense attention vs dequantize-then-attend.

Two tables, every path measured side by side in one run (interleaved repeats, so a load spike
on a shared machine hits all of them; cells are ``median (min)``):

1. *Per call at the SmolLM2-135M shape* (batch 1, 9 query heads, 3 KV heads, head_dim 64;
   4 sink + 480 quantized + 24 recent tokens, the shape of one layer's decode call at ~500
   tokens of context), in microseconds: the fused call, the same call through a
   previous revision of the kernel module (``--baseline-rev``), dense attention over the 508
   float32 tokens, and a whole ``cache.decode`` step (store + attention) of the compressed
   and of the dense cache.
2. *Long contexts* (batch 1, 32 query heads, 8 KV heads, head_dim 128, no window), in
   milliseconds:

   - ``fused``: attention straight from the packed codes (Numba kernel);
   - ``before``: the kernel module of ``--baseline-rev``, when given;
   - ``dense``: ``arraykv.attention`` over uncompressed float32 K/V, the best of OpenBLAS at
     one thread and at its default thread count (busy-waiting BLAS threads can be far slower
     on a loaded machine);
   - ``deq+attn``: dequantize the whole cache, then the same dense attention (what a cache
     without a fused path does every step), under the BLAS setting that was best for dense.

3. *SmolLM2-135M decode* (``--model-steps N``, needs the model file of ``docs/quality.md``):
   time per generated token of the whole model with each cache, one step of every cache in
   turn; with ``--baseline-rev``, ``pqo4`` also through the previous kernel. The model's
   matmuls use OpenBLAS: set ``OPENBLAS_NUM_THREADS=1`` on a busy machine.

Numba's one-time compile (or cache load) is reported separately from steady state.

Usage::

    python benchmarks/decode_cpu.py [--contexts 1024 4096 ...] [--modes pqo4 ...]
                                    [--baseline-rev b9f3283] [--repeat 7] [--skip-long]
                                    [--model-steps 32]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import os
import platform
import subprocess
import tempfile
import time
import types
from pathlib import Path

import numpy as np

import arraykv
from arraykv.ops import polar_decode_attention
from arraykv.quant.lowrank import LowRankLayerCoefficients
from arraykv.quant.polar import PolarCode, polar_decode
from arraykv.quant.vq import VQLayerCodes

PER_TOKEN = ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers", "k_qjl", "k_qjl_norms")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blas_threads():
    """``(get, set)`` for the OpenBLAS bundled with NumPy, or ``(None, None)``."""
    libs = os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*")):
        lib = ctypes.CDLL(path)
        for suffix in ("64_", ""):
            get = getattr(lib, f"scipy_openblas_get_num_threads{suffix}", None)
            put = getattr(lib, f"scipy_openblas_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                return get, put
    return None, None


def interleaved(fns, repeat, inner=1):
    """Seconds per call of each function: ``repeat`` rounds, each function once per round."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def cell(ts, unit):
    return f"{np.median(ts) * unit:.{1 if unit > 1e3 else 2}f} ({min(ts) * unit:.{1 if unit > 1e3 else 2}f})"


def load_baseline(rev):
    """The polar fused-kernel module (``arraykv/ops/numba/polar/fused.py``) as of git revision ``rev``.

    Revisions from before the ``polar`` package had it at ``arraykv/ops/numba/polar_fused.py``, and
    revisions from before the ``ops`` layer at ``arraykv/backends/_numba_fused.py``.
    """
    for path, package in (  # noqa: B007 - package is read after the loop
        ("arraykv/ops/numba/polar/fused.py", "arraykv.ops.numba.polar"),
        ("arraykv/ops/numba/polar_fused.py", "arraykv.ops.numba"),
        ("arraykv/backends/_numba_fused.py", "arraykv.backends"),
    ):
        out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if out.returncode == 0:
            break
    else:
        raise SystemExit(f"no polar fused kernel at revision {rev}")
    src = out.stdout.replace("cache=True", "cache=False")
    tmp = Path(tempfile.mkdtemp()) / "polar_fused_baseline.py"  # a file, for Numba's source lookups
    tmp.write_text(src)
    mod = types.ModuleType(f"{package}._polar_fused_baseline")
    mod.__package__, mod.__file__ = package, str(tmp)
    exec(compile(src, str(tmp), "exec"), mod.__dict__)
    return mod


def first_n(codec, n):
    """The codec state of the first ``n`` quantized tokens (views)."""
    cut = {name: getattr(codec, name)[:, :, :n, ...] for name in PER_TOKEN if getattr(codec, name) is not None}
    return dataclasses.replace(codec, n_quantized=n, **cut)


def dequantize(codec):
    """Float32 K/V of every quantized token of ``codec`` (what a dequantizing cache builds each step)."""
    d = codec.rotation.dim
    k = polar_decode(
        PolarCode(codec.k_codes, codec.k_norms, codec.k_codebook.bits, d), codec.k_codebook, codec.rotation
    )
    v = polar_decode(
        PolarCode(codec.v_codes, codec.v_norms, codec.v_codebook.bits, d), codec.v_codebook, codec.rotation
    )
    if codec.k_outlier_idx is not None and codec.k_outlier_idx.shape[-1]:
        np.put_along_axis(
            k,
            np.broadcast_to(codec.k_outlier_idx[:, :, None, :], codec.k_outliers.shape).astype(np.int64),
            codec.k_outliers.astype(np.float32),
            axis=-1,
        )
    if getattr(codec, "k_scale", None) is not None:
        k = k / codec.k_scale.astype(np.float32)[:, :, None, :]
    if codec.k_mean is not None:
        k = k + codec.k_mean.astype(np.float32)[:, :, None, :]
        v = v + codec.v_mean.astype(np.float32)[:, :, None, :]
    return k, v


def decode_and_attend(cache, k1, q, cfg):
    """One decode step as a model runs it: ``decode``, then attention when the cache returns K/V."""
    out = cache.decode(0, k1, k1, q, cfg)
    if isinstance(out, arraykv.Fused):
        return out.output
    r = out.result
    return arraykv.attention(q, r.k, r.v, softmax_scale=cfg.softmax_scale, logit_bias=r.logit_bias)


def small(args, baseline):
    """Per-call table at the SmolLM2-135M shape."""
    b, h, g, d, sinks, quantized, window = 1, 3, 3, 64, 4, 480, 24
    n = sinks + quantized + window
    rng = np.random.default_rng(args.seed)
    spread = np.ones(d)
    spread[rng.choice(d, 3, replace=False)] = 12.0  # a few outlier key channels, as in real keys
    offset = rng.standard_normal(d)
    k = (rng.standard_normal((b, h, n, d)) * spread + offset).astype(np.float32)
    v = rng.standard_normal((b, h, n, d)).astype(np.float32)
    q_pre = rng.standard_normal((b, h * g, n, d)).astype(np.float32)
    q = rng.standard_normal((b, h * g, 1, d)).astype(np.float32)
    k1 = rng.standard_normal((b, h, 1, d)).astype(np.float32)
    scale = d**-0.5
    cfg = arraykv.AttendConfig(scale, g)
    print(
        f"\n## Per call, SmolLM2-135M shape: batch {b}, {h * g} query heads, {h} KV heads, head_dim {d}, "
        f"{sinks} sink + {quantized} quantized + {window} recent tokens; microseconds, "
        f"median (min) of {args.repeat_small}"
    )
    cols = ["fused"] + (["before"] if baseline else []) + ["dense attention", "cache.decode", "dense cache.decode"]
    print("| mode | " + " | ".join(cols) + " | fused / dense | decode / dense decode |")
    print("|---" * (len(cols) + 3) + "|")
    for mode in args.modes:
        dense_cache = arraykv.make_cache("dense", num_layers=1, num_kv_heads=h, head_dim=d)
        dense_cache.prefill(0, k, v, q_pre)
        cache = arraykv.make_cache(
            mode, num_layers=1, num_kv_heads=h, head_dim=d, residual_window=window, sink_tokens=sinks
        )
        cache.prefill(0, k, v, q_pre)
        codec = cache.layer_codec_state(0)
        stepping = arraykv.make_cache(
            mode, num_layers=1, num_kv_heads=h, head_dim=d, residual_window=window, sink_tokens=sinks
        )
        stepping.prefill(0, k, v, q_pre)
        assert (codec.n_quantized, codec.n_window) == (quantized, sinks + window)
        fns = {"fused": lambda: polar_decode_attention(codec, q, scale)}
        if baseline:
            fns["before"] = lambda: baseline.polar_decode_attention(codec, q, scale)
        fns["dense attention"] = lambda: arraykv.attention(q, k, v, softmax_scale=scale)
        # decode steps grow the caches by one token per call (508 -> 828 tokens over the
        # default 16 x 20 calls): both caches by the same amount
        fns["cache.decode"] = lambda: decode_and_attend(stepping, k1, q, cfg)
        fns["dense cache.decode"] = lambda: decode_and_attend(dense_cache, k1, q, cfg)
        t = interleaved(fns, args.repeat_small, inner=20)
        med = {name: np.median(ts) for name, ts in t.items()}
        print(
            f"| {mode} | "
            + " | ".join(cell(t[c], 1e6) for c in cols)
            + f" | {med['fused'] / med['dense attention']:.2f}"
            + f" | {med['cache.decode'] / med['dense cache.decode']:.2f} |"
        )


def model_steps(args, baseline):
    """Decode time per token of SmolLM2-135M with each cache (the model's weights included)."""
    from arraykv import eval as ev
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.ops import registry

    model = load_model(None)
    context, steps = args.model_context, args.model_steps
    # the long shipped text (10k tokens) for contexts the short one cannot fill
    need = context + steps
    ids = ev.builtin_token_ids(model, need) if need <= 2048 else ev.texts.builtin_long_token_ids(model.tokenizer, need)
    key = ("polar_decode_attention", "numpy")
    registry.lookup("polar_decode_attention", np)  # resolved once, then swapped per variant
    now = registry._RESOLVED[key]
    variants = [("dense", "dense", None)]
    for mode in args.modes:
        variants.append((mode, mode, None))
        if baseline and mode == "pqo4":
            variants.append((f"{mode} before", mode, baseline.polar_decode_attention))
    caches = {}
    for name, method, _ in variants:
        caches[name] = model.make_cache(method)
        model.prefill(ids[:context], caches[name], chunk_size=512, logits="last")
    print(
        f"\n## SmolLM2-135M decode, {context} tokens of context, one step of every cache in turn; "
        f"ms per token, median (min) of {steps - 1} (the first step is a warm-up)"
    )
    times = {name: [] for name, _, _ in variants}
    try:
        for i, t in enumerate(ids[context : context + steps]):
            for name, _, fused in variants:
                registry._RESOLVED[key] = fused or now
                t0 = time.perf_counter()
                model.decode(t, caches[name])
                if i:
                    times[name].append(time.perf_counter() - t0)
    finally:
        registry._RESOLVED[key] = now
    dense = np.median(times["dense"])
    print("| cache | ms per token | time vs dense |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {cell(ts, 1e3)} | {np.median(ts) / dense:.2f} |")


def long(args, baseline):
    """Per-step table at long contexts."""
    b, hkv, g, d = 1, 8, 4, 128
    scale = d**-0.5
    top = max(args.contexts)
    rng = np.random.default_rng(args.seed)
    get_blas, set_blas = blas_threads()
    blas_default = get_blas() if get_blas else None
    blas_settings = [1, blas_default] if blas_default and blas_default > 1 else [None]
    print(
        f"\n## Long contexts: batch {b}, {hkv * g} query heads, {hkv} KV heads, head_dim {d}, float32 queries, "
        f"no window; milliseconds, median (min) of {args.repeat} (deq+attn: {max(1, args.repeat // 2)}); "
        f"dense = best of OpenBLAS threads {blas_settings}"
    )
    k = rng.standard_normal((b, hkv, top, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, top, d), dtype=np.float32)
    q = rng.standard_normal((b, hkv * g, 1, d), dtype=np.float32)
    cols = ["fused"] + (["before"] if baseline else []) + ["dense", "deq+attn"]
    print(
        "| mode | context | "
        + " | ".join(f"{c} ms" for c in cols)
        + " | fused ns / token·head | dense / fused | deq+attn / fused |"
        + (" before / fused |" if baseline else "")
    )
    print("|---" * (len(cols) + 5 + bool(baseline)) + "|")
    compile_ms = None
    for mode in args.modes:
        cache = arraykv.make_cache(mode, num_layers=1, num_kv_heads=hkv, head_dim=d, residual_window=0, sink_tokens=0)
        # one prefill: a later one would return the dequantized cache and, for tq, a QJL logit
        # bias of (batch, q_heads, new tokens, all tokens) float32
        cache.prefill(0, k, v, rng.standard_normal((b, hkv * g, top, d), dtype=np.float32))
        full = cache.layer_codec_state(0)
        if compile_ms is None:
            t0 = time.perf_counter()
            polar_decode_attention(first_n(full, 64), q, scale)
            compile_ms = 1e3 * (time.perf_counter() - t0)
        for n in args.contexts:
            codec = first_n(full, n)
            kn, vn = k[:, :, :n], v[:, :, :n]
            fns = {"fused": lambda: polar_decode_attention(codec, q, scale)}
            if baseline:
                fns["before"] = lambda: baseline.polar_decode_attention(codec, q, scale)
            for threads in blas_settings:

                def dense(threads=threads):
                    if threads is not None:
                        set_blas(threads)
                    try:
                        arraykv.attention(q, kn, vn, softmax_scale=scale)
                    finally:
                        if threads is not None:
                            set_blas(blas_default)

                fns[f"dense@{threads}"] = dense
            t = interleaved(fns, args.repeat)
            best = min(blas_settings, key=lambda th: np.median(t[f"dense@{th}"]))
            t["dense"] = t[f"dense@{best}"]
            if best is not None:
                set_blas(best)
            try:
                deq = {"deq": lambda: arraykv.attention(q, *dequantize(codec), softmax_scale=scale)}
                t["deq+attn"] = interleaved(deq, max(1, args.repeat // 2))["deq"]
            finally:
                if best is not None:
                    set_blas(blas_default)
            med = {name: np.median(ts) for name, ts in t.items()}
            row = (
                f"| {mode} | {n} | "
                + " | ".join(cell(t[c], 1e3) for c in cols)
                + f" | {med['fused'] * 1e9 / (n * b * hkv):.0f} | {med['dense'] / med['fused']:.2f}"
                + f" | {med['deq+attn'] / med['fused']:.1f} |"
            )
            if baseline:
                row += f" {med['before'] / med['fused']:.2f} |"
            print(row, flush=True)
    print(f"# first fused call (Numba compile or cache load): {compile_ms:.0f} ms")


FLOOR_SHAPES = {"32q/8kv/d128": (8, 4, 128), "SmolLM2 9q/3kv/d64": (3, 3, 64)}


def _steps(method, k, v, q, scale, rng, baseline=None):
    """``(step, bytes read)``: one fused decode-attention call of ``method`` over ``k, v`` (b, h, n, d);
    ``"pqo4 before"``: the same codec through the ``--baseline-rev`` kernel module."""
    b, h, n, d = k.shape
    if method in ("dense", "dense blas"):
        if method == "dense":
            return (lambda: arraykv.attention(q, k, v, softmax_scale=scale)), k.nbytes + v.nbytes, None
        g = q.shape[1] // h
        q4 = q.reshape(b, h, g, d) * np.float32(scale)

        def blas():  # q K^T by matmul, softmax, @ V: one (g, d) x (d, n) and one (g, n) x (n, d) per head
            s = q4 @ k.transpose(0, 1, 3, 2)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            return (s @ v) / s.sum(axis=-1, keepdims=True)

        return blas, k.nbytes + v.nbytes, None
    if method == "vq":  # codes of the vq cache's defaults (16 centroids of 2 channels: 4-bit codes), random
        m, kk = d // 2, 16
        kc, vc = (np.ascontiguousarray(rng.integers(0, 256, (b, h, n, m // 2), dtype=np.uint8)) for _ in "kv")
        cent = rng.standard_normal((h, m, kk, 2)).astype(np.float32)
        e = np.zeros((b, h, 0, d), np.float32)
        q3 = q[:, :, 0]
        codes = VQLayerCodes(kc, cent, vc, cent, bits=4)
        return (
            lambda: arraykv.ops.vq_decode_attention(q3, codes, e, e, softmax_scale=scale),
            kc.nbytes + vc.nbytes + 2 * cent.nbytes,
            None,
        )
    if method == "lowrank":  # coefficients of the lowrank cache's defaults (rank head_dim / 2, float16), random
        r = d // 2
        kc, vc = (rng.standard_normal((b, h, n, r)).astype(np.float16) for _ in "kv")
        basis = np.linalg.qr(rng.standard_normal((h, d, r)))[0].astype(np.float32)
        mean = np.zeros((h, d), np.float32)
        e = np.zeros((b, h, 0, d), np.float16)
        coefficients = LowRankLayerCoefficients(kc, basis, mean, vc, basis, mean)
        return (
            lambda: arraykv.ops.lowrank_decode_attention(q, coefficients, e, e, softmax_scale=scale),
            kc.nbytes + vc.nbytes + 2 * (basis.nbytes + mean.nbytes),
            None,
        )
    polar = method.startswith(("pq", "tq"))
    opts = dict(residual_window=0, sink_tokens=0) if polar else dict(residual_window=0)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, **opts)
    cache.prefill(0, k, v, rng.standard_normal((b, q.shape[1], n, d), dtype=np.float32))
    codec = cache.layer_codec_state(0)
    fn = polar_decode_attention if polar else arraykv.ops.int_decode_attention
    before = None if baseline is None else (lambda: baseline.polar_decode_attention(codec, q, scale))
    return (lambda: fn(codec, q, scale)), cache.memory_usage(), before


def floor_table(args, baseline=None):
    """Every method's fused step beside its floor and the fastest dense float32 attention, two shapes."""
    import cpu_floor
    import numba

    threads = numba.get_num_threads()
    get_blas, _ = blas_threads()
    n = args.floor_context
    print(
        f"\n## Decode attention vs the floor: batch 1, {n} tokens, no window, Numba threads {threads}, "
        f"OpenBLAS threads {get_blas() if get_blas else '?'}; ms, median (min-max) of {args.repeat}"
    )
    print(cpu_floor.describe(threads))
    print("| shape | method | ms | floor ms (memory / compute) | time / floor | best dense / time |")
    print("|---|---|---|---|---|---|")
    for label, (h, g, d) in FLOOR_SHAPES.items():
        rng = np.random.default_rng(args.seed)
        k = rng.standard_normal((1, h, n, d), dtype=np.float32)
        v = rng.standard_normal((1, h, n, d), dtype=np.float32)
        q = rng.standard_normal((1, h * g, 1, d), dtype=np.float32)
        fns, floors = {}, {}
        for method in args.floor_methods:
            fns[method], nbytes, before = _steps(
                method, k, v, q, d**-0.5, rng, baseline if method.startswith("pq") else None
            )
            if before is not None:
                fns[f"{method} before"] = before
                floors[f"{method} before"] = cpu_floor.floor_seconds(nbytes, fmas=n * h * g * 2 * d, threads=threads)
            # multiply-add lanes per (token, query head): score + value over d channels; lowrank: rank
            # d / 2 each; vq (2-channel sub-spaces): d / 2 table entries added for the score (16 tokens
            # per vpermps + add, as a multiply-add) and d multiply-adds for the value
            ops = n * h * g * {"vq": d // 2 + d, "lowrank": d}.get(method, 2 * d)
            floors[method] = cpu_floor.floor_seconds(nbytes, fmas=ops, threads=threads)
        t = interleaved(fns, args.repeat)
        med = {name: np.median(ts) for name, ts in t.items()}
        dense = min(med[m] for m in med if m.startswith("dense")) if any(m.startswith("dense") for m in med) else None
        for method, ts in t.items():
            f = floors[method]
            vs_dense = f"{dense / med[method]:.2f}" if dense else "-"
            print(
                f"| {label} | {method} | {np.median(ts) * 1e3:.2f} ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}) "
                f"| {f['floor'] * 1e3:.2f} ({f['memory'] * 1e3:.2f} / {f['compute'] * 1e3:.2f}) "
                f"| {med[method] / f['floor']:.1f} | {vs_dense} |",
                flush=True,
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536])
    ap.add_argument("--modes", nargs="+", default=["pqo2", "pqo3", "pqo4", "tq3"])
    ap.add_argument("--repeat", type=int, default=5, help="rounds per long-context row")
    ap.add_argument("--repeat-small", type=int, default=15, help="rounds (of 20 calls) per SmolLM2-shape row")
    ap.add_argument("--baseline-rev", default=None, help="git revision whose polar fused kernel is timed as 'before'")
    ap.add_argument(
        "--model-steps",
        type=int,
        default=0,
        help="decode steps of SmolLM2-135M per cache (0: skip; needs the GGUF, see docs/quality.md)",
    )
    ap.add_argument("--model-context", type=int, default=512)
    ap.add_argument(
        "--floor",
        action="store_true",
        help="only the table of every method beside its floor (see benchmarks/cpu_floor.py)",
    )
    ap.add_argument("--floor-context", type=int, default=32768)
    ap.add_argument("--floor-methods", nargs="+", default=["pqo4", "pqo2", "int4", "int8", "vq", "dense", "dense blas"])
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import numba

    blas_get, _ = blas_threads()
    print(
        f"# machine: {platform.machine()}, {os.cpu_count()} cores, OpenBLAS threads "
        f"{blas_get() if blas_get else '?'}, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, numpy {np.__version__}, numba {numba.__version__} "
        f"({numba.get_num_threads()} threads)"
    )
    baseline = load_baseline(args.baseline_rev) if args.baseline_rev else None
    if args.floor:
        floor_table(args, baseline)
        return
    if not args.skip_small:
        small(args, baseline)
    if args.model_steps:
        model_steps(args, baseline)
    if not args.skip_long:
        long(args, baseline)


if __name__ == "__main__":
    main()
