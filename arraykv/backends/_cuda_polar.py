"""GPU launchers for ``kernels/polar.cu``: quantize, dequantize and fused decode attention.

Launch geometry is planned by plain functions (``plan_*``) that check their arguments and need
no GPU, so the checks are tested everywhere; the launchers themselves need CuPy. Scratch
buffers of the decode kernel are reused per thread and shape, not allocated per call.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

from ._cuda import get_kernel, require_cupy

__all__ = ["plan_codec_launch", "plan_decode_attn", "polar_encode", "polar_decode", "polar_decode_attention"]

_SOURCE = "polar.cu"
MAX_GROUP = 8      # query heads served by one block (register/shared-memory budget)
WARPS = 4          # warps per decode block
MIN_TOKENS_PER_SPLIT = 64
_scratch = threading.local()


class CodecLaunch(NamedTuple):
    """One block of ``dim`` threads per vector."""

    rows: int
    grid: tuple
    block: tuple
    name: str


def plan_codec_launch(kind: str, rows: int, dim: int, bits: int, hadamard: bool, dtype_name: str) -> CodecLaunch:
    """Geometry and kernel name of a quantize (``kind="quantize"``) or dequantize launch."""
    if kind not in ("quantize", "dequantize"):
        raise ValueError(f"kind must be 'quantize' or 'dequantize', received {kind!r}")
    if dim % 32 or not 32 <= dim <= 1024:
        raise ValueError(f"head_dim must be a multiple of 32 between 32 and 1024 on the GPU, received {dim}")
    if hadamard and dim & (dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, received {dim}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, received {bits}")
    if dtype_name not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32 or float16 on the GPU, received {dtype_name}")
    if rows < 0 or rows >= 2**31:
        raise ValueError(f"rows must be in [0, 2**31), received {rows}")
    ctype = "float" if dtype_name == "float32" else "__half"
    name = f"polar_{kind}<{ctype}, {dim}, {bits}, {'true' if hadamard else 'false'}>"
    return CodecLaunch(rows, (max(rows, 1),), (dim,), name)


class AttnLaunch(NamedTuple):
    """Decode-attention geometry: query-head chunks of at most ``MAX_GROUP``, token splits."""

    chunks: tuple          # (first query head, count, GMAX) per launch
    splits: int
    grid: tuple
    block: tuple
    names: tuple


def plan_decode_attn(batch: int, kv_heads: int, groups: int, head_dim: int, tokens: int, k_bits: int, v_bits: int,
                     qjl: bool, sm_count: int = 132) -> AttnLaunch:
    """Plan the fused decode launches (checked; no GPU needed).

    Splits are chosen so that about two blocks per multiprocessor run, each with at least
    ``MIN_TOKENS_PER_SPLIT`` tokens.
    """
    if head_dim % 32 or not 32 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a multiple of 32 up to 256 for the fused GPU kernel, received {head_dim}")
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if not 1 <= bits <= 8:
            raise ValueError(f"{name} must be in 1..8, received {bits}")
    if batch < 1 or kv_heads < 1 or groups < 1:
        raise ValueError(f"batch, kv_heads and groups must be >= 1, received {batch}, {kv_heads}, {groups}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, received {tokens}")
    if batch > 65535 or kv_heads > 65535:
        raise ValueError("batch and kv_heads must be at most 65535 (grid limits)")
    want = math.ceil(2 * sm_count / (batch * kv_heads))
    splits = max(1, min(want, math.ceil(tokens / MIN_TOKENS_PER_SPLIT)))
    chunks, names = [], []
    for first in range(0, groups, MAX_GROUP):
        count = min(MAX_GROUP, groups - first)
        gmax = 1 << (count - 1).bit_length()
        chunks.append((first, count, gmax))
        names.append(f"polar_decode_attn<{head_dim}, {k_bits}, {v_bits}, {gmax}, {'true' if qjl else 'false'}, {WARPS}>")
    return AttnLaunch(tuple(chunks), splits, (splits, kv_heads, batch), (WARPS * 32,), tuple(names))


def _device_sm_count(cp) -> int:
    dev = cp.cuda.Device()
    return int(dev.attributes.get("MultiProcessorCount", 132))


def _hadamard(rotation) -> bool:
    return rotation.matrix is None


def polar_encode(x, rotation, codebook):
    """GPU ``polar_encode``: CuPy ``(..., dim)`` float16/float32 -> (codes uint8, gains float16)."""
    cp = require_cupy()
    dim = int(x.shape[-1])
    if x.dtype not in (cp.float16, cp.float32):
        x = x.astype(cp.float32)
    x = cp.ascontiguousarray(x)
    rows = int(x.size // dim)
    plan = plan_codec_launch("quantize", rows, dim, int(codebook.bits), _hadamard(rotation), str(x.dtype))
    codes = cp.empty(x.shape[:-1] + (dim * codebook.bits // 8,), dtype=cp.uint8)
    gains = cp.empty(x.shape[:-1], dtype=cp.float16)
    if rows:
        matrix = rotation.matrix if rotation.matrix is not None else rotation.signs
        kern = get_kernel(_SOURCE, plan.name)
        kern(plan.grid, plan.block, (x, cp.int64(rows), rotation.signs, matrix, codebook.thresholds,
                                     codebook.centroids, codes, gains))
    return codes, gains


def polar_decode(codes, norms, rotation, codebook):
    """GPU ``polar_decode``: packed codes + float16 gains -> float32 ``(..., dim)``."""
    cp = require_cupy()
    dim = rotation.dim
    codes = cp.ascontiguousarray(codes)
    norms = cp.ascontiguousarray(norms.astype(cp.float16, copy=False))
    rows = int(norms.size)
    plan = plan_codec_launch("dequantize", rows, dim, int(codebook.bits), _hadamard(rotation), "float32")
    out = cp.empty(tuple(norms.shape) + (dim,), dtype=cp.float32)
    if rows:
        matrix = rotation.matrix if rotation.matrix is not None else rotation.signs
        kern = get_kernel(_SOURCE, plan.name)
        kern(plan.grid, plan.block, (codes, norms, cp.int64(rows), rotation.signs, matrix, codebook.centroids, out))
    return out


def _buffers(cp, shape_key, b, h, splits, g, d):
    cache = getattr(_scratch, "bufs", None)
    if cache is None:
        cache = _scratch.bufs = {}
    key = (cp.cuda.Device().id, shape_key)
    bufs = cache.get(key)
    if bufs is None:
        bufs = (cp.empty((b, h, splits, g), cp.float32), cp.empty((b, h, splits, g), cp.float32),
                cp.empty((b, h, splits, g, d), cp.float32))
        cache[key] = bufs
    return bufs


def _capacity(arr) -> int:
    """Token capacity of the buffer behind a (b, h, n, ...) view (from its strides)."""
    return int(arr.strides[1] // arr.strides[2]) if arr.shape[1] > 1 or arr.shape[0] > 1 else int(arr.shape[2])


def polar_decode_attention(codec, q, scale):
    """Fused decode attention on the GPU over a :class:`~arraykv.caches.polar.PolarLayerCodec`."""
    cp = require_cupy()
    from ..attention.polar_fused import merge_window, prepare_queries

    prep = prepare_queries(codec, q, scale)
    b, h, g, d = (int(s) for s in prep["qr"].shape)
    n = codec.n_quantized
    if n == 0:
        m = cp.full((b, h, g), -cp.inf, dtype=cp.float32)
        return merge_window(codec, prep, scale, m, cp.zeros((b, h, g), cp.float32), cp.zeros((b, h, g, d), cp.float32), q.dtype)
    use_qjl = codec.qjl is not None
    plan = plan_decode_attn(b, h, g, d, n, int(codec.k_codebook.bits), int(codec.v_codebook.bits), use_qjl,
                            _device_sm_count(cp))
    cap = _capacity(codec.k_norms)
    for arr in (codec.k_codes, codec.v_codes, codec.v_norms):
        if _capacity(arr) != cap or arr.strides[-1] != arr.itemsize:
            raise ValueError("the codec arrays must be token views of one contiguous buffer")
    nout = int(prep["qout"].shape[-1])
    m_rows = int(prep["sq"].shape[-1]) if use_qjl else 0
    dummy_h = cp.zeros(1, cp.float16)
    dummy_u8 = cp.zeros(1, cp.uint8)
    dummy_f = cp.zeros(1, cp.float32)
    ms, ls, accs = [], [], []
    for (first, count, _gmax), name in zip(plan.chunks, plan.names):
        sl = slice(first, first + count)
        qr = cp.ascontiguousarray(prep["qr"][:, :, sl])
        qconst = cp.ascontiguousarray(prep["qconst"][:, :, sl])
        qout = cp.ascontiguousarray(prep["qout"][:, :, sl]) if nout else dummy_f
        sq = cp.ascontiguousarray(prep["sq"][:, :, sl]) if use_qjl else dummy_f
        out_m, out_l, out_acc = _buffers(cp, (b, h, plan.splits, count, d), b, h, plan.splits, count, d)
        kern = get_kernel(_SOURCE, name)
        kern(plan.grid, plan.block,
             (qr, qconst, qout, sq, codec.k_codes, codec.k_norms, codec.k_codebook.centroids, codec.v_codes,
              codec.v_norms, codec.v_codebook.centroids, codec.k_outliers if nout else dummy_h,
              codec.k_qjl if use_qjl else dummy_u8, codec.k_qjl_norms if use_qjl else dummy_h,
              cp.int32(n), cp.int64(cap), cp.int32(count), cp.int32(nout), cp.int32(m_rows), cp.int32(plan.splits),
              out_m, out_l, out_acc))
        ms.append(out_m), ls.append(out_l), accs.append(out_acc)
    out_m, out_l, out_acc = (cp.concatenate(x, axis=3) for x in (ms, ls, accs))
    m = out_m.max(axis=2)
    w = cp.where(cp.isfinite(out_m), cp.exp(out_m - m[:, :, None, :]), 0.0).astype(cp.float32)
    l = (out_l * w).sum(axis=2)
    acc = (out_acc * w[..., None]).sum(axis=2)
    return merge_window(codec, prep, scale, m, l, acc, q.dtype)
