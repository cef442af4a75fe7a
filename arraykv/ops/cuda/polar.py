"""GPU launchers for ``kernels/polar.cu``: quantize, dequantize and fused decode attention.

Launch geometry is planned by plain functions (``plan_*`` in :mod:`.polar_plan`, re-exported
here) that check their arguments and need no GPU, so the checks are tested everywhere; the
launchers themselves need CuPy (``PREFETCH`` here is the variant they launch). A decode step
is three launches on the current stream (queries prepared, split-K attention over the packed
codes, merge with the float16 window) and no host synchronisation; its scratch buffers are
kept per thread and shape and reused, not allocated per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from ... import _compat
from ..._types import Array, DType, Namespace
from ...attention.polar_fused import polar_decode_attention_reference
from ...quant.codebooks import Codebook
from ...quant.polar import polar_decode_reference, polar_encode_reference
from ...quant.qjl import QJL_SCALE
from ...quant.rotary_mean import RotaryMeanPlan
from ...quant.rotation import Rotation
from .loader import get_kernel, require_cupy
from .polar_plan import (  # noqa: F401 - re-exported: the launch planning lives in polar_plan
    BLOCKS_PER_SM,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_OUTLIERS,
    PREFETCH,
    TILE,
    WARPS,
    AttnLaunch,
    CodecLaunch,
    codec_unsupported_reason,
    kernel_names,
    plan_codec_launch,
    plan_decode_attn,
)

__all__ = [
    "plan_codec_launch",
    "plan_decode_attn",
    "polar_encode",
    "polar_decode",
    "polar_decode_attention",
    "polar_encode_into",
    "polar_decode_into",
    "polar_decode_attention_into",
    "rotary_phase_rows",
    "scratch_buffers",
    "unsupported_reason",
    "SOURCE",
    "name_expressions",
]

#: The file under ``kernels/`` these launchers run.
SOURCE = "polar.cu"
_SCRATCH_ENTRIES = 16
_scratch = threading.local()
_SM_COUNT: dict[int, int] = {}
#: ``(head_dim, hadamard)`` and ``(key bits, value bits, qjl)`` that :func:`name_expressions`
#: covers: the head sizes of the supported models, the smallest one and a dense rotation, and
#: every code width the presets use.
_BUILD_HEADS = ((64, True), (128, True), (256, True), (96, False), (32, True))
_BUILD_BITS = ((4, 4, False), (3, 3, False), (2, 2, True), (1, 1, False), (3, 2, True))


def name_expressions() -> list[str]:
    """Kernel name expressions these launchers ask the compiler for, over the configurations the caches use.

    Returns
    -------
    list of str
        Sorted, without repeats: every decode-step kernel (both variants of prefetch and of the
        logit bias) and the quantize/dequantize kernels for float32 and float16, for each
        configuration of ``_BUILD_HEADS`` and ``_BUILD_BITS``. A build check compiles them
        all, so a template that fails to instantiate is caught without a GPU.
    """
    names: set[str] = set()
    for d, had in _BUILD_HEADS:
        for kb, vb, qjl in _BUILD_BITS:
            for pf in (False, True):
                for bias in (False, True):
                    names.update(kernel_names(d, kb, vb, qjl, had, pf, bias).values())
        for kind in ("quantize", "dequantize"):
            for dt in ("float32", "float16"):
                names.add(plan_codec_launch(kind, 1, d, 3, had, dt).name)
    return sorted(names)


def _device_sm_count(cp: Namespace) -> int:
    dev = cp.cuda.Device().id
    n = _SM_COUNT.get(dev)
    if n is None:
        n = _SM_COUNT[dev] = int(cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return n


_OCCUPANCY: dict[tuple[int, str], int] = {}


def _blocks_per_sm(cp: Namespace, kern: Any, name: str) -> int:
    """Resident attention blocks per multiprocessor for ``kern`` (driver occupancy query)."""
    key = (cp.cuda.Device().id, name)
    n = _OCCUPANCY.get(key)
    if n is None:
        try:
            n = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, WARPS * 32, 0))
        except Exception:  # no occupancy query in this CuPy: from the register count (64K per SM)
            try:
                regs = int(kern.num_regs)
                n = 65536 // (-(-regs * 32 // 256) * 256 * WARPS)
            except Exception:
                n = BLOCKS_PER_SM
        _OCCUPANCY[key] = n = max(1, n)
    return n


def _hadamard(rotation: Rotation) -> bool:
    return rotation.matrix is None


def _check_out(cp: Namespace, out: Array | None, shape: tuple[int, ...], dtype: DType, name: str) -> Array:
    if out is None:
        return cp.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(
            f"{name} must be a C-contiguous {cp.dtype(dtype).name} array of shape {tuple(shape)}, "
            f"received {out.dtype} {tuple(out.shape)}"
        )
    return out


def polar_encode(x: Array, codebook: Codebook, rotation: Rotation, *, unbiased: bool = False) -> tuple[Array, Array]:
    """GPU :func:`arraykv.quant.polar.polar_encode_reference`: CuPy ``(..., dim)`` -> (codes uint8, gains float16).

    Vectors the kernel does not code (``codec_unsupported_reason``: a head_dim that is not a
    multiple of 32, say) go through the reference, on the GPU all the same.
    """
    dtype = str(x.dtype) if str(x.dtype) in ("float16", "float32") else "float32"
    if codec_unsupported_reason(int(x.shape[-1]), int(codebook.bits), _hadamard(rotation), dtype) is not None:
        return polar_encode_reference(x, codebook, rotation, unbiased=unbiased)
    return polar_encode_into(x, codebook, rotation, unbiased=unbiased)


def polar_decode(codes: Array, norms: Array, codebook: Codebook, rotation: Rotation) -> Array:
    """GPU :func:`arraykv.quant.polar.polar_decode_reference`: packed codes + gains -> float32 ``(..., dim)``.

    Geometries the kernel does not serve go through the reference (see :func:`polar_encode`).
    """
    if codec_unsupported_reason(int(rotation.dim), int(codebook.bits), _hadamard(rotation), "float32") is not None:
        return polar_decode_reference(codes, norms, codebook, rotation)
    return polar_decode_into(codes, norms, codebook, rotation)


def polar_encode_into(
    x: Array,
    codebook: Codebook,
    rotation: Rotation,
    *,
    unbiased: bool = False,
    codes_out: Array | None = None,
    norms_out: Array | None = None,
) -> tuple[Array, Array]:
    """GPU ``polar_encode``: CuPy ``(..., dim)`` float16/float32 -> (codes uint8, gains float16).

    ``unbiased`` stores ``‖x‖ / ⟨y, ŷ⟩`` instead of the least-squares length.
    ``codes_out`` / ``norms_out``, when given, receive the result (C-contiguous, exact shapes).
    """
    cp = require_cupy()
    dim = int(x.shape[-1])
    if x.dtype not in (cp.float16, cp.float32):
        x = x.astype(cp.float32)
    x = cp.ascontiguousarray(x)
    rows = int(x.size // dim)
    plan = plan_codec_launch("quantize", rows, dim, int(codebook.bits), _hadamard(rotation), str(x.dtype))
    codes = _check_out(cp, codes_out, x.shape[:-1] + (dim * codebook.bits // 8,), cp.uint8, "codes_out")
    gains = _check_out(cp, norms_out, x.shape[:-1], cp.float16, "norms_out")
    if rows:
        matrix = rotation.matrix if rotation.matrix is not None else rotation.signs
        kern = get_kernel(SOURCE, plan.name)
        kern(
            plan.grid,
            plan.block,
            (
                x,
                cp.int64(rows),
                rotation.signs,
                matrix,
                codebook.thresholds,
                codebook.centroids,
                codes,
                gains,
                cp.int32(1 if unbiased else 0),
            ),
        )
    return codes, gains


def polar_decode_into(
    codes: Array, norms: Array, codebook: Codebook, rotation: Rotation, *, out: Array | None = None
) -> Array:
    """GPU ``polar_decode``: packed codes + float16 gains -> float32 ``(..., dim)`` (into ``out`` if given)."""
    cp = require_cupy()
    dim = rotation.dim
    codes = cp.ascontiguousarray(codes)
    norms = cp.ascontiguousarray(norms.astype(cp.float16, copy=False))
    rows = int(norms.size)
    plan = plan_codec_launch("dequantize", rows, dim, int(codebook.bits), _hadamard(rotation), "float32")
    out = _check_out(cp, out, tuple(norms.shape) + (dim,), cp.float32, "out")
    if rows:
        matrix = rotation.matrix if rotation.matrix is not None else rotation.signs
        kern = get_kernel(SOURCE, plan.name)
        kern(plan.grid, plan.block, (codes, norms, cp.int64(rows), rotation.signs, matrix, codebook.centroids, out))
    return out


# ---- fused decode attention ------------------------------------------------------------------
def _store() -> dict[tuple[Any, ...], dict[str, Array]]:
    st = getattr(_scratch, "bufs", None)
    if st is None:
        st = _scratch.bufs = {}
    return st


def scratch_buffers() -> list[Array]:
    """The decode scratch arrays held by the calling thread (tests poison them)."""
    return [a for bufs in _store().values() for a in bufs.values()]


def _buffers(cp: Namespace, key: tuple[Any, ...], shapes: dict[str, tuple[tuple[int, ...], DType]]) -> dict[str, Array]:
    """Per-thread scratch arrays for ``key``, allocated on first use and then reused."""
    store = _store()
    full = (cp.cuda.Device().id,) + key
    bufs = store.get(full)
    if bufs is None:
        if len(store) >= _SCRATCH_ENTRIES:
            store.clear()
        bufs = store[full] = {name: cp.empty(shape, dtype=dt) for name, (shape, dt) in shapes.items()}
    return bufs


def _capacity(arr: Array) -> int:
    """Token capacity of the buffer behind a (b, h, n, ...) view (from its strides)."""
    return int(arr.strides[1] // arr.strides[2]) if arr.shape[1] > 1 or arr.shape[0] > 1 else int(arr.shape[2])


def _token_view_ok(arr: Array, cap: int) -> bool:
    """A (b, h, n, ...) view of a C-contiguous (b, h, cap, ...) buffer, 16-byte aligned."""
    inner = arr.itemsize
    for s in arr.shape[3:]:
        inner *= int(s)
    b, h = int(arr.shape[0]), int(arr.shape[1])
    if arr.shape[3:] and arr.strides[-1] != arr.itemsize:
        return False
    if int(arr.strides[2]) != inner or arr.data.ptr % 16:
        return False
    if h > 1 and int(arr.strides[1]) != cap * inner:
        return False
    if b > 1 and int(arr.strides[0]) != h * cap * inner:
        return False
    return _capacity(arr) == cap or (b == 1 and h == 1)


def unsupported_reason(codec: Any, q: Array, rotary_plan: RotaryMeanPlan | None = None) -> str | None:
    """Why the fused GPU kernel cannot serve this call (None when it can).

    ``rotary_plan``: the codec's rotating-key-mean plan when the caller has made it
    (:func:`_rotary_plan`), so that a step makes it once."""
    d = int(q.shape[-1])
    if d % 32 or d > MAX_HEAD_DIM:
        return f"head_dim {d} is not a multiple of 32 up to {MAX_HEAD_DIM}"
    if str(q.dtype) not in ("float32", "float16"):
        return f"queries of dtype {q.dtype}"
    if int(q.shape[2]) != 1:
        return "more than one query token"
    if codec.qjl is not None and int(codec.qjl.rows) != d:
        return f"a QJL sketch of {codec.qjl.rows} rows (the kernel needs head_dim rows)"
    if getattr(codec, "k_mean_freq", None) is not None:
        plan = rotary_plan if rotary_plan is not None else _rotary_plan(codec)
        if not plan.shared:
            return "a rotating key mean whose heads turn at different frequencies"
    if codec.k_outlier_idx is not None and int(codec.k_outlier_idx.shape[-1]) > MAX_OUTLIERS:
        return f"more than {MAX_OUTLIERS} outlier channels"
    if codec.n_quantized:
        cap = _capacity(codec.k_norms)
        arrays = [codec.k_codes, codec.k_norms, codec.v_codes, codec.v_norms]
        if codec.k_outliers is not None and codec.k_outlier_idx is not None:
            arrays.append(codec.k_outliers)
        if codec.qjl is not None:
            arrays += [codec.k_qjl, codec.k_qjl_norms]
        if not all(_token_view_ok(a, cap) for a in arrays):
            return "codec arrays that are not token views of one contiguous buffer"
    return None


def _rotary_plan(codec: Any) -> RotaryMeanPlan:
    """The codec's rotating-key-mean plan, or one made here from its arrays when it carries none
    or one of another namespace (a torch cache's plan, when the codec's tensors reach this op as
    CuPy views through :mod:`arraykv.ops.bridge`)."""
    plan = getattr(codec, "k_mean_plan", None)
    if plan is None or plan.xp is not _compat.namespace(codec.k_mean):
        plan = RotaryMeanPlan(codec.k_mean, codec.k_mean_freq, codec.k_mean_pairs)
    return plan


def rotary_phase_rows(freq: Array, start: int, n: int, family: Iterable[str] | None = None) -> Array:
    """GPU :meth:`~arraykv.quant.rotary_mean.RotaryMeanPlan.phase_rows`: float32 ``[cos ω t | sin ω t | 1]``.

    The rows are (n, 2J + 1).

    One launch; each angle is reduced to [-π, π] in double precision (positions reach 10⁵).
    ``family``: the kernel names compiled with it in one module (a decode step's).
    """
    cp = require_cupy()
    freq = cp.ascontiguousarray(freq, dtype=cp.float32)
    n_pairs = int(freq.shape[0])
    out = cp.empty((n, 2 * n_pairs + 1), dtype=cp.float32)
    if n:
        total = out.size
        threads = 256
        blocks = min(-(-total // threads), 65535)
        get_kernel(SOURCE, "rotary_phases", family)(
            (blocks,), (threads,), (freq, cp.int32(n_pairs), cp.int64(start), cp.int32(n), out)
        )
    return out


def _key_mean_bias(
    cp: Namespace,
    codec: Any,
    q: Array,
    scale: float,
    n: int,
    family: Iterable[str] | None,
    phase_rows: Callable[[Array, int, int, Iterable[str] | None], Array] = rotary_phase_rows,
    plan: RotaryMeanPlan | None = None,
) -> Array:
    """``scale · q · R_p μ`` for the quantized tokens, positions ``n_sink .. n_sink + n - 1``: (B*H*G, n) float32.

    :meth:`~arraykv.quant.rotary_mean.RotaryMeanPlan.logits` (one cuBLAS product of the plan's
    coefficients with the phase rows) with the phase rows from ``phase_rows(freq, start, n,
    family)``, the kernel of :func:`rotary_phase_rows`; ``plan`` the codec's plan when the caller
    has it (:func:`_rotary_plan`).
    """
    b, qh, _, d = (int(s) for s in q.shape)
    h = int(codec.k_codes.shape[1])
    plan = plan if plan is not None else _rotary_plan(codec)
    start = int(codec.n_sink)
    out = plan.logits(
        q.astype(cp.float32).reshape(b, h, qh // h, d) * float(scale),
        start,
        start + n,
        phases=phase_rows(plan.freq, start, n, family),
    )
    return out.reshape(b * qh, n)


def _half_or_dummy(cp: Namespace, arr: Array | None, dummy: Array) -> Array:
    return dummy if arr is None else cp.ascontiguousarray(arr)


def polar_decode_attention(codec: Any, q: Array, scale: float) -> Array:
    """GPU :func:`~arraykv.attention.polar_fused.polar_decode_attention_reference`.

    See :func:`polar_decode_attention_into`.
    """
    return polar_decode_attention_into(codec, q, scale)


def polar_decode_attention_into(codec: Any, q: Array, scale: float, *, out: Array | None = None) -> Array:
    """Fused decode attention on the GPU over a :class:`~arraykv.caches.polar.PolarLayerCodec`.

    Parameters
    ----------
    codec : PolarLayerCodec
        CuPy arrays.
    q : cupy.ndarray, shape (batch, q_heads, 1, head_dim), float16 or float32
    scale : float
        Softmax scale.
    out : cupy.ndarray, optional
        Receives the result (same shape and dtype as ``q``, C-contiguous).

    Returns
    -------
    cupy.ndarray, shape (batch, q_heads, 1, head_dim), dtype of ``q``

    Notes
    -----
    Same contract as :func:`arraykv.attention.polar_fused.polar_decode_attention_reference`,
    which serves the calls the kernel does not (``unsupported_reason``). The products run on
    the tensor cores with float16 operands (queries, centroids, softmax weights times value
    gains) and float32 accumulation; the softmax, norms, outlier channels, centering and the
    window are float32. The result agrees with the float32 reference to about 1e-3 relative.
    """
    cp = require_cupy()
    # a rotating key mean's plan, made once per step (a foreign-namespace codec's is rebuilt here)
    rplan = _rotary_plan(codec) if getattr(codec, "k_mean_freq", None) is not None else None
    if unsupported_reason(codec, q, rplan) is not None:
        return polar_decode_attention_reference(codec, q, scale)
    b, qh, _, d = (int(s) for s in q.shape)
    h = int(codec.k_window.shape[1]) if codec.k_window is not None else int(codec.k_codes.shape[1])
    g = qh // h
    n = int(codec.n_quantized)
    dtype = str(q.dtype)
    qc = cp.ascontiguousarray(q)
    out = _check_out(cp, out, tuple(q.shape), q.dtype, "out")
    rot = codec.rotation
    had = _hadamard(rot)
    use_qjl = codec.qjl is not None
    nout = 0 if codec.k_outlier_idx is None else int(codec.k_outlier_idx.shape[-1])
    kb, vb = int(codec.k_codebook.bits), int(codec.v_codebook.bits)
    # a rotating key mean adds a logit term per token (one product, cuBLAS); a fixed one a constant
    rotating = n > 0 and rplan is not None
    names = kernel_names(d, kb, vb, use_qjl, had, PREFETCH, rotating)
    family = tuple(names.values())
    attn = get_kernel(SOURCE, names["attn"], family)
    plan = (
        plan_decode_attn(
            b,
            h,
            g,
            d,
            n,
            kb,
            vb,
            use_qjl,
            _device_sm_count(cp),
            _blocks_per_sm(cp, attn, names["attn"]),
            PREFETCH,
            rotating,
        )
        if n
        else None
    )
    splits = plan.splits if plan else 0
    f32, f16 = cp.float32, cp.float16
    bufs = _buffers(
        cp,
        ("attn", b, h, g, d, nout, use_qjl, splits),
        {
            "qr": ((b * h * g * d,), f32),
            "qconst": ((b * h * g,), f32),
            "qout": ((max(b * h * g * nout, 1),), f32),
            "sq": ((b * h * g * d if use_qjl else 1,), f32),
            "out_m": ((max(b * h * splits * g, 1),), f32),
            "out_l": ((max(b * h * splits * g, 1),), f32),
            "out_acc": ((max(b * h * splits * g * d, 1),), f32),
            "dummy_f": ((4,), f32),
            "dummy_h": ((8,), f16),
            "dummy_i": ((4,), cp.int32),
            "dummy_u8": ((16,), cp.uint8),
        },
    )
    dh, df = bufs["dummy_h"], bufs["dummy_f"]
    matrix = rot.matrix if rot.matrix is not None else rot.signs
    sketch = codec.qjl.matrix if use_qjl else df
    sq_scale = float(scale) * QJL_SCALE / int(codec.qjl.rows) if use_qjl else 0.0
    idx = cp.ascontiguousarray(codec.k_outlier_idx) if nout else bufs["dummy_i"]

    bias = _key_mean_bias(cp, codec, qc, scale, n, family, plan=rplan) if rotating else df
    prep = get_kernel(SOURCE, names[f"prepare_{dtype}"], family)
    prep(
        (g, h, b),
        (d,),
        (
            qc,
            _half_or_dummy(cp, codec.k_scale, dh),
            _half_or_dummy(cp, codec.k_mean, dh),
            idx,
            cp.int32(nout),
            rot.signs,
            matrix,
            sketch,
            cp.float32(scale),
            cp.float32(sq_scale),
            cp.int32(codec.k_scale is not None),
            cp.int32(codec.k_mean is not None and rplan is None),
            cp.int32(use_qjl),
            bufs["qr"],
            bufs["qconst"],
            bufs["qout"],
            bufs["sq"],
        ),
    )
    if plan is not None:  # n > 0
        cap = _capacity(codec.k_norms)
        k_out = codec.k_outliers if nout else dh
        k_qjl = codec.k_qjl if use_qjl else bufs["dummy_u8"]
        k_qjl_n = codec.k_qjl_norms if use_qjl else dh
        for first, count in plan.chunks:
            attn(
                plan.grid,
                plan.block,
                (
                    bufs["qr"],
                    bufs["qconst"],
                    bufs["qout"],
                    bufs["sq"],
                    bias,
                    codec.k_codes,
                    codec.k_norms,
                    codec.k_codebook.centroids,
                    codec.v_codes,
                    codec.v_norms,
                    codec.v_codebook.centroids,
                    k_out,
                    k_qjl,
                    k_qjl_n,
                    cp.int32(n),
                    cp.int64(cap),
                    cp.int32(g),
                    cp.int32(first),
                    cp.int32(count),
                    cp.int32(nout),
                    cp.int32(plan.tiles_per_split),
                    cp.int32(splits),
                    bufs["out_m"],
                    bufs["out_l"],
                    bufs["out_acc"],
                ),
            )
    n_win = int(codec.n_window)
    kw = cp.ascontiguousarray(codec.k_window) if n_win else dh
    vw = cp.ascontiguousarray(codec.v_window) if n_win else dh
    merge = get_kernel(SOURCE, names[f"merge_{dtype}"], family)
    merge(
        (g, h, b),
        (d,),
        (
            bufs["out_m"],
            bufs["out_l"],
            bufs["out_acc"],
            cp.int32(splits),
            qc,
            kw,
            vw,
            cp.int32(n_win),
            _half_or_dummy(cp, codec.v_mean, dh),
            cp.int32(codec.v_mean is not None),
            rot.signs,
            matrix,
            cp.float32(scale),
            out,
        ),
    )
    return out
