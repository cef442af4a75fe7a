"""Fused decode attention ops: one decode step straight from a layer's codes.

Each function takes exactly the arguments of its array-API reference in
:mod:`arraykv.attention` and runs the kernel registered for the namespace of ``q``
(:mod:`arraykv.ops.registry`) or that reference. :func:`has_kernel` tells a cache whether a
fused kernel would serve a call, so it can decide between a fused decode and returning
dequantized K/V.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._types import Array, Device, Namespace
from .._validation import check_softmax_scale
from ..attention.int_fused import layer_exponents
from ..quant.lowrank import LowRankLayerCoefficients
from ..quant.vq import VQLayerCodes
from .registry import implementation, lookup, reference

__all__ = [
    "polar_decode_attention",
    "int_decode_attention",
    "vq_decode_attention",
    "lowrank_decode_attention",
    "has_kernel",
    "INT_KERNEL_BITS",
]

#: Code widths of the integer fused kernel (others run the reference).
INT_KERNEL_BITS = (2, 4, 8)


def has_kernel(name: str, xp: Namespace, device: Device = None) -> bool:
    """Whether op ``name`` has a usable kernel for namespace ``xp`` (kernels enabled and importable).

    For PyTorch without a ``device``: whether it has one for CPU or CUDA tensors
    (:func:`arraykv.ops.registry.lookup`).
    """
    return lookup(name, xp, device) is not None


def _device(xp: Namespace, x: Array) -> Device:
    """``x``'s device where the namespace needs it to pick a kernel (PyTorch), else None."""
    return _compat.device(x) if _compat.is_torch(xp) else None


def polar_decode_attention(codec: Any, q: Array, scale: float) -> Array:
    """Attention of one query per head over a PolarQuant layer, from its packed codes.

    Parameters
    ----------
    codec : PolarLayerCodec
        The layer's state (``PolarCache.layer_codec_state``).
    q : array, shape (batch, q_heads, 1, head_dim)
    scale : float
        Softmax scale.

    Returns
    -------
    array, shape (batch, q_heads, 1, head_dim), dtype of ``q``
        Equal (to float32 rounding) to ``attention(q, K, V, logit_bias=B)`` over the layer's
        dequantized keys/values and QJL bias
        (:func:`arraykv.attention.polar_fused.polar_decode_attention_reference`).
    """
    scale = check_softmax_scale(scale, "scale")
    xp = _compat.namespace(q)
    return implementation("polar_decode_attention", xp, _device(xp, q))(codec, q, scale)


def int_decode_attention(codec: Any, q: Array, scale: float) -> Array:
    """Attention of one query per head over an integer-cache layer, from its packed codes.

    Parameters
    ----------
    codec : IntLayerCodec
        The layer's state (``IntQuantCache.layer_codec_state``); at least one token.
    q : array, shape (batch, q_heads, 1, head_dim)
        ``q_heads`` a multiple of the layer's KV heads; query head ``i`` reads KV head
        ``i // (q_heads // kv_heads)``.
    scale : float
        Softmax scale.

    Returns
    -------
    array, shape (batch, q_heads, 1, head_dim), dtype of ``q``
        Equal (to float32 rounding) to ``attention(q, K, V)`` over the layer's dequantized keys
        and values (:func:`arraykv.attention.int_fused.int_decode_attention_reference`);
        computed in float32. The kernel covers 2-, 4- and 8-bit codes; other widths run the
        reference.
    """
    scale = check_softmax_scale(scale, "scale")
    xp = _compat.namespace(q)
    fast = lookup("int_decode_attention", xp, _device(xp, q)) if int(codec.bits) in INT_KERNEL_BITS else None
    if fast is None:
        return reference("int_decode_attention")(codec, q, scale)
    k_exp, v_exp = layer_exponents(codec)
    out = fast(codec, q, scale * 2.0**k_exp)  # the kernels read keys and values in their stored units
    return out * 2.0**v_exp if v_exp else out


def vq_decode_attention(
    q: Array, layer_codes: VQLayerCodes, k_extra: Array, v_extra: Array, *, softmax_scale: float
) -> Array:
    """One decode step of attention over VQ-coded keys and values plus a few dense tokens.

    Arguments and result of :func:`arraykv.attention.vq_fused.vq_decode_attention_reference`:
    ``q`` (batch, q_heads, head_dim), the layer's codes (batch, h, T, ·), codebooks (h, m, K, s)
    and code width (:class:`~arraykv.quant.vq.VQLayerCodes`), dense tokens (batch, h, E,
    head_dim); returns float32 (batch, q_heads, head_dim).
    """
    softmax_scale = check_softmax_scale(softmax_scale)
    xp = _compat.namespace(q)
    fn = implementation("vq_decode_attention", xp, _device(xp, q))
    return fn(q, layer_codes, k_extra, v_extra, softmax_scale=softmax_scale)


def lowrank_decode_attention(
    q: Array, layer_coefficients: LowRankLayerCoefficients, k_extra: Array, v_extra: Array, *, softmax_scale: float
) -> Array:
    """One decode step of attention over a low-rank layer, in coefficient space.

    Arguments and result of :func:`arraykv.attention.lowrank_fused.lowrank_decode_attention`:
    ``q`` (batch, q_heads, 1, head_dim), the layer's coefficients (batch, h, T, r) of float16 or
    float32, bases (h, head_dim, r) and means (h, head_dim) (None when ``T = 0``;
    :class:`~arraykv.quant.lowrank.LowRankLayerCoefficients`), kept tokens (batch, h, E,
    head_dim); returns (batch, q_heads, 1, head_dim) in the dtype of ``q``. On NumPy the kernel
    reads float16 coefficients in place instead of converting the layer at every step.
    """
    xp = _compat.namespace(q)
    fn = implementation("lowrank_decode_attention", xp, _device(xp, q))
    return fn(q, layer_coefficients, k_extra, v_extra, softmax_scale=softmax_scale)
