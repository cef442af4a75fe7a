"""Decode attention straight from a PolarQuant/TurboQuant layer, in the rotated domain.

For one new query per head this computes ``softmax(scale · q Kᵀ + bias) V`` over every token
of a :class:`~arraykv.caches.polar.PolarLayerCodec` without building K or V in the original
domain. :func:`polar_decode_attention_reference` is the array-API version the fused kernels
are tested against; ``arraykv.ops.polar_decode_attention`` picks a kernel for the namespace
(Numba on NumPy, CUDA on CuPy) or this reference.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._types import Array, DType
from .._validation import check_softmax_scale
from ..quant.bitpack import unpack_bits
from ..quant.qjl import QJL_SCALE
from ..quant.rotary_mean import rotary_mean_at
from ..quant.rotation import rotate, unrotate

__all__ = ["polar_decode_attention_reference", "prepare_queries", "key_mean_logits", "merge_window"]


def prepare_queries(codec: Any, q: Array, scale: float) -> dict:
    """Per-query quantities that turn a token's codes into its logit.

    Parameters
    ----------
    codec : PolarLayerCodec
    q : array, shape (batch, q_heads, 1, head_dim)
    scale : float

    Returns
    -------
    dict of float32 arrays, ``G = q_heads // kv_heads``:
        ``q`` (b, h, G, d) the queries; ``qr`` (b, h, G, d) ``scale · M q̃`` with the outlier
        channels of ``q̃`` zeroed; ``qconst`` (b, h, G) ``scale · q · k_mean``; ``qout``
        (b, h, G, n_out) ``scale · q`` at the outlier channels; ``sq`` (b, h, G, m)
        ``scale · √(π/2)/m · S q`` for QJL keys (absent otherwise). With a rotating key mean
        (``codec.k_mean_freq``) ``qconst`` is 0: the mean's share of each logit depends on the
        token's position (:func:`key_mean_logits`).

    Notes
    -----
    Keys are stored as ``s ⊙ (k − mean)`` (``s`` the layer's ``k_scale`` channel weights, ones
    when absent): ``k_t = mean + (E_t + Mᵀ(n_t c[codes_t])) / s`` with ``E_t`` the exact outlier
    channels (the rotated part encoded with those channels zeroed and decoded with them
    overwritten). So with ``q' = q / s`` and ``q̃`` = ``q'`` with the outlier channels zeroed,
    ``scale · q·k_t = qconst + qout·E_t + n_t · qr·c[codes_t]`` and the QJL sketch is applied
    to ``q̃`` (the residual lives in the same weighted, outlier-free space).
    """
    xp = _compat.namespace(q)
    b, qh, _, d = (int(s) for s in q.shape)
    h = int(codec.k_window.shape[1]) if codec.k_window is not None else int(codec.k_codes.shape[1])
    g = qh // h
    q32 = xp.reshape(xp.astype(q, xp.float32), (b, h, g, d))
    out = {"q": q32}
    # keys were encoded as s ⊙ (k − mean): the coded part is read with q / s
    k_scale = getattr(codec, "k_scale", None)
    qs = q32 if k_scale is None else q32 / xp.astype(k_scale, xp.float32)[:, :, None, :]
    qt = qs
    n_out = 0 if codec.k_outlier_idx is None else int(codec.k_outlier_idx.shape[-1])
    if n_out:
        ar = xp.arange(d, dtype=xp.int32, device=_compat.device(q))
        sel = xp.astype(ar[None, None, :, None] == codec.k_outlier_idx[:, :, None, :], xp.float32)  # (b,h,d,n)
        out["qout"] = xp.matmul(qs, sel) * scale
        qt = qs * (1.0 - xp.sum(sel, axis=-1))[:, :, None, :]
    else:
        out["qout"] = xp.zeros((b, h, g, 0), dtype=xp.float32, device=_compat.device(q))
    out["qr"] = rotate(qt, codec.rotation) * scale
    if codec.k_mean is not None and getattr(codec, "k_mean_freq", None) is None:
        out["qconst"] = xp.sum(q32 * xp.astype(codec.k_mean, xp.float32)[:, :, None, :], axis=-1) * scale
    else:
        out["qconst"] = xp.zeros((b, h, g), dtype=xp.float32, device=_compat.device(q))
    if codec.qjl is not None:
        m = codec.qjl.rows
        out["sq"] = xp.matmul(qt, xp.matrix_transpose(codec.qjl.matrix)) * (scale * QJL_SCALE / m)
    return out


def key_mean_logits(codec: Any, q32: Array, scale: float, t0: int, t1: int) -> Array:
    """``scale · q · m_p`` for the quantized tokens ``t0 .. t1 - 1`` of a rotating key mean.

    Parameters
    ----------
    codec : PolarLayerCodec
        With ``k_mean_freq`` (else the mean is in ``qconst`` and this is not needed).
    q32 : array (b, h, G, d) float32
    scale : float
    t0, t1 : int
        Quantized-token range; token ``t`` sits at position ``n_sink + t``.

    Returns
    -------
    array (b, h, G, t1 - t0) float32
    """
    xp = _compat.namespace(q32)
    pos = xp.arange(codec.n_sink + t0, codec.n_sink + t1, dtype=xp.float64, device=_compat.device(q32))
    mt = rotary_mean_at(codec.k_mean, codec.k_mean_freq, codec.k_mean_pairs, pos)  # (b, h, n, d)
    return xp.matmul(q32, xp.matrix_transpose(mt)) * scale


def merge_window(codec: Any, prep: dict, scale: float, m: Array, l: Array, acc_rot: Array, out_dtype: DType) -> Array:
    """Combine the quantized tokens' softmax state with the float16 window; return the output.

    Parameters
    ----------
    m, l : arrays (b, h, G) float32
        Running maximum and sum of ``exp(logit - m)`` over the quantized tokens (``m = -inf``
        and ``l = 0`` when there are none).
    acc_rot : array (b, h, G, d) float32
        ``Σ_t exp(logit_t - m) · n_t c[codes_t]`` in the rotated value domain.

    Returns
    -------
    array (b, q_heads, 1, d) in ``out_dtype``.
    """
    xp = _compat.namespace(acc_rot)
    b, h, g, d = (int(s) for s in acc_rot.shape)
    num = unrotate(acc_rot, codec.rotation)  # back from the rotated domain: Mᵀ y
    if codec.v_mean is not None:
        num = num + l[..., None] * xp.astype(codec.v_mean, xp.float32)[:, :, None, :]
    if codec.n_window:
        kw = xp.astype(codec.k_window, xp.float32)
        vw = xp.astype(codec.v_window, xp.float32)
        sw = xp.matmul(prep["q"], xp.matrix_transpose(kw)) * scale  # (b, h, G, W)
        mw = xp.max(sw, axis=-1)
        mt = xp.maximum(m, mw)
        a = xp.exp(m - mt)
        ew = xp.exp(sw - mt[..., None])
        num = num * a[..., None] + xp.matmul(ew, vw)
        den = l * a + xp.sum(ew, axis=-1)
    else:
        den = l
    out = num / den[..., None]
    return xp.astype(xp.reshape(out, (b, h * g, 1, d)), out_dtype)


def polar_decode_attention_reference(codec: Any, q: Array, scale: float) -> Array:
    """Array-API version: decode every code in the rotated domain, then one softmax.

    Same inputs and output as :func:`polar_decode_attention`. Memory is O(tokens · head_dim)
    (it builds the rotated values of every token); the fused kernels avoid that.
    """
    scale = check_softmax_scale(scale, "scale")
    xp = _compat.namespace(q)
    prep = prepare_queries(codec, q, scale)
    b, h, g, d = (int(s) for s in prep["q"].shape)
    dev = _compat.device(q)
    n = codec.n_quantized
    if n == 0:
        m = xp.full((b, h, g), -float("inf"), dtype=xp.float32, device=dev)
        l = xp.zeros((b, h, g), dtype=xp.float32, device=dev)
        acc = xp.zeros((b, h, g, d), dtype=xp.float32, device=dev)
        return merge_window(codec, prep, scale, m, l, acc, q.dtype)
    kc = xp.take(
        codec.k_codebook.centroids,
        xp.reshape(xp.astype(unpack_bits(codec.k_codes, codec.k_codebook.bits, d), xp.int64), (-1,)),
    )
    ky = xp.reshape(kc, (b, h, n, d)) * xp.astype(codec.k_norms, xp.float32)[..., None]
    s = xp.matmul(prep["qr"], xp.matrix_transpose(ky)) + prep["qconst"][..., None]  # (b, h, G, n)
    if getattr(codec, "k_mean_freq", None) is not None:
        s = s + key_mean_logits(codec, prep["q"], scale, 0, n)
    if int(prep["qout"].shape[-1]):
        s = s + xp.matmul(prep["qout"], xp.matrix_transpose(xp.astype(codec.k_outliers, xp.float32)))
    if codec.qjl is not None:
        pm = 2.0 * xp.astype(unpack_bits(codec.k_qjl, 1, codec.qjl.rows), xp.float32) - 1.0  # (b,h,n,m)
        s = s + xp.matmul(prep["sq"], xp.matrix_transpose(pm)) * xp.astype(codec.k_qjl_norms, xp.float32)[:, :, None, :]
    m = xp.max(s, axis=-1)
    e = xp.exp(s - m[..., None])
    l = xp.sum(e, axis=-1)
    vc = xp.take(
        codec.v_codebook.centroids,
        xp.reshape(xp.astype(unpack_bits(codec.v_codes, codec.v_codebook.bits, d), xp.int64), (-1,)),
    )
    vy = xp.reshape(vc, (b, h, n, d)) * xp.astype(codec.v_norms, xp.float32)[..., None]
    acc = xp.matmul(e, vy)
    return merge_window(codec, prep, scale, m, l, acc, q.dtype)
