"""Decode attention over vector-quantized (product-quantization) keys and values: the reference.

:func:`vq_decode_attention_reference` decodes the codes (:mod:`arraykv.quant.vq`) and runs the
reference attention; the fused CPU kernel (``arraykv.ops.vq_decode_attention``) is tested
against it.
"""

from __future__ import annotations

from .. import _compat
from .._types import Array
from ..quant.vq import VQCodebook, VQCodes, VQLayerCodes, check_decode_attention_args, vq_decode
from .reference import attention

__all__ = ["vq_decode_attention_reference"]


def vq_decode_attention_reference(
    q: Array, layer_codes: VQLayerCodes, k_extra: Array, v_extra: Array, *, softmax_scale: float
) -> Array:
    """One decode step of attention over VQ-coded (product-quantized) keys and values plus a few dense tokens.

    Decodes every key and value with :func:`~arraykv.quant.vq.vq_decode`, appends the dense tokens and runs
    :func:`arraykv.attention.reference.attention` (no causal mask: one query sees every token).

    Parameters
    ----------
    q : array of float, shape (batch, q_heads, head_dim)
        The new token's queries; ``q_heads`` is a multiple of the KV heads ``h`` and query head
        ``i`` uses KV head ``i // (q_heads // h)`` (grouped-query attention).
    layer_codes : VQLayerCodes
        The layer's codes (batch, h, T, ·), codebooks (h, m, K, s) and code width
        (:class:`~arraykv.quant.vq.VQLayerCodes`), ``m * s == head_dim``.
    k_extra, v_extra : array of float, shape (batch, h, E, head_dim)
        Dense tokens (a cache's float16 sinks and recent window); ``E`` may be 0.
    softmax_scale : float
        Multiplies ``q · k`` before the softmax.

    Returns
    -------
    array of float32, shape (batch, q_heads, head_dim)

    Raises
    ------
    ValueError
        On inconsistent shapes or dtypes, or when ``T + E == 0``.

    Notes
    -----
    With ``K_t`` the decoded keys and dense keys, ``out = softmax(scale · q K_tᵀ) V_t``. The
    fused kernel (``arraykv.ops.vq_decode_attention`` on NumPy) computes the same without
    decoding: see :mod:`arraykv.ops.numba.vq_fused`.
    """
    xp = _compat.namespace(q)
    lc = layer_codes
    k_codes, k_centroids, v_codes, v_centroids = lc.k_codes, lc.k_centroids, lc.v_codes, lc.v_centroids
    b, hq, h, t, e, d, m, bits = check_decode_attention_args(
        q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, lc.bits
    )
    f32 = xp.float32
    ks, vs = [], []
    if t > 0:
        kcb = VQCodebook(centroids=xp.astype(k_centroids, f32, copy=False))
        vcb = VQCodebook(centroids=xp.astype(v_centroids, f32, copy=False))
        ks.append(vq_decode(VQCodes(codes=k_codes, bits=bits, subspaces=m), kcb, f32))
        vs.append(vq_decode(VQCodes(codes=v_codes, bits=bits, subspaces=m), vcb, f32))
    if e > 0:
        ks.append(xp.astype(k_extra, f32, copy=False))
        vs.append(xp.astype(v_extra, f32, copy=False))
    k = ks[0] if len(ks) == 1 else xp.concat(ks, axis=2)
    v = vs[0] if len(vs) == 1 else xp.concat(vs, axis=2)
    q4 = xp.reshape(xp.astype(q, f32, copy=False), (b, hq, 1, d))
    out = attention(q4, k, v, softmax_scale=float(softmax_scale), causal=False)
    return xp.reshape(out, (b, hq, d))
