"""Reading a polar cache layer back: K/V from its codes, and the QJL logit correction.

Both work on one layer's state (:class:`~arraykv.caches.polar.PolarLayer`) and the cache's
fixed arrays (:class:`~arraykv.caches.polar_codec.PolarFixed`); the fused decode attention
reads the same state without building K/V (:mod:`arraykv.attention.polar_fused`).
"""

from __future__ import annotations

from .. import _compat, ops
from .._types import Array
from ..quant.polar import PolarCode, polar_decode
from ..quant.polar_tokens import outlier_selector
from ..quant.qjl import QJL_SCALE
from .polar_calibration import PolarCalibration
from .polar_codec import PolarFixed
from .polar_options import PolarOptions
from .window import WindowLayer

__all__ = ["decode_layer", "decode_tokens", "qjl_logit_bias"]


def decode_layer(st: WindowLayer, fixed: PolarFixed, opts: PolarOptions, start: int = 0) -> tuple[Array, Array]:
    """float32 K/V of the tokens ``start ..`` of layer ``st``: (b, h, total - start, d) each.

    Layout: the sink tokens, the encoded tokens, the recent window; only the codes of tokens
    from ``start`` on are decoded. An encoded token ``t`` is ``k̂'/s + m_t`` with ``k̂'`` the
    rotated codes times their length and the exact outlier channels put back.
    """
    xp = st.xp
    buf = st.codes
    parts_k, parts_v = [], []
    n_s = st.exact.n_sink
    kx = xp.astype(st.exact.k, xp.float32)
    vx = xp.astype(st.exact.v, xp.float32)
    if start < n_s:
        parts_k.append(kx[:, :, start:n_s, :])
        parts_v.append(vx[:, :, start:n_s, :])
    c0 = min(max(0, start - n_s), buf.length)
    if buf.length > c0:
        kd, vd = decode_tokens(
            {n: buf.view(n)[:, :, c0:, ...] for n in buf.names()},
            st.calib,
            fixed,
            opts.key_bits,
            opts.value_bits,
            n_s + c0,
        )
        parts_k.append(kd)
        parts_v.append(vd)
    w0 = n_s + max(0, start - n_s - buf.length)
    parts_k.append(kx[:, :, w0:, :])
    parts_v.append(vx[:, :, w0:, :])
    if len(parts_k) == 1:
        return parts_k[0], parts_v[0]
    return xp.concat(parts_k, axis=2), xp.concat(parts_v, axis=2)


def decode_tokens(
    codes: dict[str, Array], calib: PolarCalibration, fixed: PolarFixed, key_bits: int, value_bits: int, position: int
) -> tuple[Array, Array]:
    """float32 K/V, (b, h, t, d) each, of tokens encoded by ``ops.polar_encode_tokens``.

    Parameters
    ----------
    codes : dict
        ``k_codes``, ``v_codes`` uint8 (b, h, t, packed), ``k_norms``, ``v_norms`` float16
        (b, h, t), and ``k_outliers`` float16 (b, h, t, n_out) when the calibration keeps
        outlier channels.
    calib : PolarCalibration
        The calibration the tokens were encoded with.
    fixed : PolarFixed
        Rotation and codebooks.
    key_bits, value_bits : int
    position : int
        Position of the first token (where the key mean turns with the position).

    Notes
    -----
    A token ``k̂'`` (the rotated codes times their length, the exact outlier channels put
    back) decodes to ``k̂'/s + m_p``; a value to ``v̂ + v_mean``.
    """
    xp = _compat.namespace(codes["k_codes"])
    d = fixed.rotation.dim
    kq = PolarCode(codes["k_codes"], codes["k_norms"], key_bits, d)
    vq = PolarCode(codes["v_codes"], codes["v_norms"], value_bits, d)
    kd = polar_decode(kq, fixed.k_codebook, fixed.rotation, decode=ops.polar_decode)
    vd = polar_decode(vq, fixed.v_codebook, fixed.rotation, decode=ops.polar_decode)
    if calib.n_outliers > 0:
        sel = outlier_selector(xp, calib.k_outlier_idx, d)
        keep = 1.0 - xp.sum(sel, axis=-1)[:, :, None, :]
        kd = kd * keep + xp.matmul(xp.astype(codes["k_outliers"], xp.float32), xp.matrix_transpose(sel))
    n = int(kd.shape[2])
    kd = kd / xp.astype(calib.k_scale, xp.float32)[:, :, None, :] + calib.key_mean(xp, position, n)
    vd = vd + xp.astype(calib.v_mean, xp.float32)[:, :, None, :]
    return kd, vd


def qjl_logit_bias(st: WindowLayer, fixed: PolarFixed, q: Array, scale: float) -> Array:
    """``(batch, q_heads, new_tokens, total)`` float32 QJL logit correction of layer ``st``, times ``scale``.

    For an encoded key with residual sketch ``±1(S r)`` and norm ``‖r‖`` the logit of ``q``
    gains ``scale · √(π/2)/m · ‖r‖ · ⟨S q̃, ±1(S r)⟩`` with ``q̃ = (q / s) ⊙ keep`` (the
    residual lives in the weighted key space without the outlier channels); exact tokens gain
    nothing.
    """
    xp = st.xp
    buf = st.codes
    b, qh, t, d = (int(s) for s in q.shape)
    h = int(st.exact.k.shape[1])
    g = qh // h
    n_s = st.exact.n_sink
    n_q, n_w = buf.length, st.exact.n_recent
    parts = []
    if n_s:
        parts.append(xp.zeros((b, qh, t, n_s), dtype=xp.float32, device=st.device))
    if n_q:
        sk = fixed.qjl
        assert sk is not None  # a layer holds sketched keys only with the sketch
        m = sk.rows
        calib = st.calib
        w = 1.0 / xp.astype(calib.k_scale, xp.float32)  # (b, h, d)
        if calib.n_outliers > 0:
            w = w * (1.0 - xp.sum(outlier_selector(xp, calib.k_outlier_idx, d), axis=-1))
        qt = xp.reshape(xp.astype(q, xp.float32), (b, h, g * t, d)) * w[:, :, None, :]
        sq = xp.matmul(qt, xp.matrix_transpose(sk.matrix))  # (b, h, g*t, m)
        pm = 2.0 * xp.astype(ops.unpack_bits(buf.view("k_qjl"), 1, m), xp.float32) - 1.0  # (b, h, n_q, m)
        dots = xp.matmul(sq, xp.matrix_transpose(pm))  # (b, h, g*t, n_q)
        w = xp.astype(buf.view("k_qjl_norms"), xp.float32) * (scale * QJL_SCALE / m)
        parts.append(xp.reshape(dots * w[:, :, None, :], (b, qh, t, n_q)))
    if n_w:
        parts.append(xp.zeros((b, qh, t, n_w), dtype=xp.float32, device=st.device))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=3)
