"""Launch planning for ``kernels/polar.cu``: geometry, kernel names and their checks; no GPU needed.

:mod:`.polar` (the launchers, which need CuPy) re-exports every name here.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

__all__ = [
    "CodecLaunch",
    "AttnLaunch",
    "codec_unsupported_reason",
    "plan_codec_launch",
    "plan_decode_attn",
    "kernel_names",
    "MAX_GROUP",
    "WARPS",
    "TILE",
    "BLOCKS_PER_SM",
    "PREFETCH",
    "MAX_OUTLIERS",
    "MAX_HEAD_DIM",
]

MAX_GROUP = 8  # query heads served by one attention launch (the mma N dimension)
WARPS = 4  # warps per attention block
TILE = 16  # tokens per warp step
BLOCKS_PER_SM = 4  # attention blocks per multiprocessor when the occupancy query is unavailable
#: Load the next tile's codes while the current one is computed. Measured on an H100 (pqo4,
#: head_dim 128, two runs): 167 instead of 127 registers, 3 instead of 4 blocks per
#: multiprocessor, and within the run-to-run spread (-2% at 32k tokens in both runs, +2.6% and
#: -4% at 128k), so off: the variant without it is the one the full GPU test suite ran on. The
#: benchmark times both.
PREFETCH = False
MAX_OUTLIERS = 32  # exact outlier key channels the attention kernel holds (polar.cu)
MAX_HEAD_DIM = 256


def _ctype(dtype_name: str) -> str:
    return "float" if dtype_name == "float32" else "unsigned short"


def _bool(flag: bool) -> str:
    return "true" if flag else "false"


class CodecLaunch(NamedTuple):
    """One block of ``dim`` threads per vector."""

    rows: int
    grid: tuple
    block: tuple
    name: str


def codec_unsupported_reason(dim: int, bits: int, hadamard: bool, dtype_name: str) -> str | None:
    """Why the quantize/dequantize kernels cannot code vectors of this kind (None when they can).

    The kernels run one thread per channel of a vector, so ``dim`` is a multiple of 32 (whole
    warps) up to 1024 (one block), a power of two with the Hadamard rotation; the callers in
    :mod:`.polar` run the array-API reference for anything else.
    """
    if dim % 32 or not 32 <= dim <= 1024:
        return f"head_dim must be a multiple of 32 between 32 and 1024 on the GPU, received {dim}"
    if hadamard and dim & (dim - 1):
        return f"the Hadamard rotation needs a power-of-two head_dim, received {dim}"
    if not 1 <= bits <= 8:
        return f"bits must be in 1..8, received {bits}"
    if dtype_name not in ("float32", "float16"):
        return f"dtype must be float32 or float16 on the GPU, received {dtype_name}"
    return None


def plan_codec_launch(kind: str, rows: int, dim: int, bits: int, hadamard: bool, dtype_name: str) -> CodecLaunch:
    """Geometry and kernel name of a quantize (``kind="quantize"``) or dequantize launch.

    Parameters
    ----------
    kind : {"quantize", "dequantize"}
    rows : int
        Vectors to code.
    dim : int
        Vector length, a multiple of 32 up to 1024 (a power of two for the Hadamard rotation).
    bits : int
        Bits per code, 1 to 8.
    hadamard : bool
        Fast Walsh-Hadamard rotation (else a dense matrix).
    dtype_name : {"float32", "float16"}
        Dtype of the quantizer's input or the dequantizer's output.

    Returns
    -------
    CodecLaunch
    """
    if kind not in ("quantize", "dequantize"):
        raise ValueError(f"kind must be 'quantize' or 'dequantize', received {kind!r}")
    reason = codec_unsupported_reason(dim, bits, hadamard, dtype_name)
    if reason is not None:
        raise ValueError(reason)
    if rows < 0 or rows >= 2**31:
        raise ValueError(f"rows must be in [0, 2**31), received {rows}")
    name = f"polar_{kind}<{_ctype(dtype_name)}, {dim}, {bits}, {_bool(hadamard)}>"
    return CodecLaunch(rows, (max(rows, 1),), (dim,), name)


class AttnLaunch(NamedTuple):
    """Decode-attention geometry: query-head chunks of at most ``MAX_GROUP``, token splits.

    ``tiles_per_split`` tiles of ``TILE`` tokens per split; every split holds at least one.
    ``name`` is the attention kernel; :func:`kernel_names` gives all three kernels of a step.
    """

    chunks: tuple  # (first query head, count) per attention launch
    splits: int
    tiles_per_split: int
    grid: tuple
    block: tuple
    name: str


def plan_decode_attn(
    batch: int,
    kv_heads: int,
    groups: int,
    head_dim: int,
    tokens: int,
    k_bits: int,
    v_bits: int,
    qjl: bool,
    sm_count: int = 132,
    blocks_per_sm: int = BLOCKS_PER_SM,
    prefetch: bool | None = None,
    bias: bool = False,
) -> AttnLaunch:
    """Plan the fused decode launches (checked; no GPU needed).

    Parameters
    ----------
    batch, kv_heads, groups : int
        ``groups`` query heads per KV head.
    head_dim : int
        A multiple of 32 up to 256.
    tokens : int
        Quantized tokens, >= 1.
    k_bits, v_bits : int
        Bits of the key and value codes, 1 to 8.
    qjl : bool
        Keys carry a QJL sketch.
    sm_count : int
        Multiprocessors of the device.
    blocks_per_sm : int
        Attention blocks resident per multiprocessor (from the occupancy query).
    prefetch : bool, optional
        Kernel variant (default: the module's ``PREFETCH``).
    bias : bool
        The variant that adds a logit term per query and token (a rotating key mean).

    Returns
    -------
    AttnLaunch
        Splits are chosen so that the blocks fill the ``blocks_per_sm`` slots of every
        multiprocessor in one wave (not more), each warp with at least one tile of ``TILE``
        tokens.
    """
    if head_dim % 32 or not 32 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be a multiple of 32 up to {MAX_HEAD_DIM} for the fused GPU kernel, received {head_dim}"
        )
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if not 1 <= bits <= 8:
            raise ValueError(f"{name} must be in 1..8, received {bits}")
    if batch < 1 or kv_heads < 1 or groups < 1:
        raise ValueError(f"batch, kv_heads and groups must be >= 1, received {batch}, {kv_heads}, {groups}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, received {tokens}")
    if batch > 65535 or kv_heads > 65535:
        raise ValueError("batch and kv_heads must be at most 65535 (grid limits)")
    chunks = tuple((first, min(MAX_GROUP, groups - first)) for first in range(0, groups, MAX_GROUP))
    tiles = math.ceil(tokens / TILE)
    # one wave: a second, partial wave would double the time of the step
    want = max(1, max(1, blocks_per_sm) * sm_count // (batch * kv_heads * len(chunks)))
    splits = max(1, min(want, math.ceil(tiles / WARPS)))
    per = math.ceil(tiles / splits)
    splits = math.ceil(tiles / per)  # no empty split
    pf = PREFETCH if prefetch is None else prefetch
    extra = ", true" if bias else ""  # the template's last argument defaults to false
    name = f"polar_decode_attn<{head_dim}, {k_bits}, {v_bits}, {_bool(qjl)}, {WARPS}, {_bool(pf)}{extra}>"
    return AttnLaunch(chunks, splits, per, (splits, kv_heads, batch), (WARPS * 32,), name)


@functools.lru_cache(maxsize=256)
def kernel_names(
    head_dim: int, k_bits: int, v_bits: int, qjl: bool, hadamard: bool, prefetch: bool = False, bias: bool = False
) -> dict:
    """Name expressions of a decode step's kernels (compiled together as one module; read only)."""
    names = {"attn": plan_decode_attn(1, 1, 1, head_dim, 1, k_bits, v_bits, qjl, prefetch=prefetch, bias=bias).name}
    for dtype in ("float32", "float16"):
        t = _ctype(dtype)
        names[f"prepare_{dtype}"] = f"polar_prepare_queries<{t}, {head_dim}, {_bool(hadamard)}>"
        names[f"merge_{dtype}"] = f"polar_merge_window<{t}, {head_dim}, {_bool(hadamard)}>"
    names["phases"] = "rotary_phases"  # a rotating key mean's phase rows
    return names
