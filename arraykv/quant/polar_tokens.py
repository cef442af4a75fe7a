"""Encoding the tokens that leave a polar cache's exact window, in one op.

A polar cache (``pqo``/``pq``) stores a token's key as ``s ⊙ (k − m_p)`` (``m_p`` the key mean
at the token's position ``p``, plain or turning with it: :mod:`arraykv.quant.rotary_mean`;
``s`` the key channel weights) with its outlier channels cut out and kept in float16, and its
value as ``v − v_mean``; both then go through TurboQuant-MSE (:func:`arraykv.quant.polar.polar_encode`).
:func:`polar_encode_tokens_reference` is that sequence in array-API code;
``arraykv.ops.polar_encode_tokens`` runs it as one compiled call on NumPy, where a decode step
(one token per layer) otherwise spends more time in the twenty-odd small array operations
than in the arithmetic.
"""

from __future__ import annotations

from .. import _compat
from .._types import Array, Namespace
from .polar import half_dtype, polar_decode_reference, polar_encode_reference
from .polar_encoder import PolarEncoder
from .qjl import qjl_encode
from .rotary_mean import RotaryMeanPlan

__all__ = ["polar_encode_tokens_reference", "center_tokens", "outlier_selector"]


def outlier_selector(xp: Namespace, idx: Array, d: int) -> Array:
    """One-hot ``(b, h, d, n_out)`` float32 matrix selecting the channels ``idx`` (b, h, n_out)."""
    ar = xp.arange(d, dtype=xp.int32, device=_compat.device(idx))
    return xp.astype(ar[None, None, :, None] == idx[:, :, None, :], xp.float32)


def center_tokens(k: Array, v: Array, key_mean: Array, v_mean: Array, k_scale: Array, k_outlier_idx: Array) -> tuple:
    """The parts of tokens ``k``, ``v`` (b, h, t, d) float32 that TurboQuant encodes.

    ``key_mean`` is the key mean at the tokens' positions, (b, h, t, d) or (b, h, 1, d) float32;
    ``v_mean``, ``k_scale`` float16 (b, h, d); ``k_outlier_idx`` int32 (b, h, n_out).

    Returns
    -------
    kc, vc : float32 (b, h, t, d)
        ``s ⊙ (k − m_p)`` with the outlier channels zeroed, and ``v − v_mean``.
    k_outliers : float16 (b, h, t, n_out), or None when ``n_out == 0``
        The outlier channels of ``s ⊙ (k − m_p)``.
    keep : float32 (b, h, 1, d), or None when ``n_out == 0``
        1 on the coded channels, 0 on the outlier ones.
    """
    xp = _compat.namespace(k)
    kc = (k - key_mean) * xp.astype(k_scale, xp.float32)[:, :, None, :]
    vc = v - xp.astype(v_mean, xp.float32)[:, :, None, :]
    if not int(k_outlier_idx.shape[-1]):
        return kc, vc, None, None
    sel = outlier_selector(xp, k_outlier_idx, int(k.shape[-1]))
    keep = 1.0 - xp.sum(sel, axis=-1)[:, :, None, :]
    return kc * keep, vc, xp.astype(xp.matmul(kc, sel), half_dtype(xp)), keep


def polar_encode_tokens_reference(k: Array, v: Array, enc: PolarEncoder, start: int) -> dict:
    """Quantize float32 tokens ``k``, ``v`` (b, h, t, d) at positions ``start .. start + t - 1``.

    Parameters
    ----------
    k, v : float32 (b, h, t, d)
    enc : PolarEncoder
        The layer's calibration, the codebooks and rotation, the length rules and, for ``tq``
        keys, the QJL sketch: then each key's residual ``r = k_c − k̂_c`` (the coded part minus
        its reconstruction from the stored codes and float16 length, zero on the outlier
        channels) is sketched too.
    start : int
        Position of the first token.

    Returns
    -------
    dict
        ``k_codes``, ``v_codes`` uint8 (b, h, t, packed), ``k_norms``, ``v_norms`` float16
        (b, h, t); when ``n_out > 0``, ``k_outliers`` float16 (b, h, t, n_out); with a sketch,
        ``k_qjl`` uint8 (b, h, t, ceil(m / 8)) (the packed signs of ``S r``) and
        ``k_qjl_norms`` float16 (b, h, t) (``‖r‖``).
    """
    xp = _compat.namespace(k)
    if enc.k_mean_freq is None:
        mean = xp.astype(enc.k_mean, xp.float32)[:, :, None, :]
    else:
        pos = xp.arange(start, start + int(k.shape[2]), dtype=xp.float64, device=_compat.device(k))
        mean = RotaryMeanPlan(enc.k_mean, enc.k_mean_freq, enc.k_mean_pairs).at(pos)
    kc, vc, k_outliers, keep = center_tokens(k, v, mean, enc.v_mean, enc.k_scale, enc.k_outlier_idx)
    out = {} if k_outliers is None else {"k_outliers": k_outliers}
    out["k_codes"], out["k_norms"] = polar_encode_reference(kc, enc.k_codebook, enc.rotation, unbiased=enc.key_unbiased)
    out["v_codes"], out["v_norms"] = polar_encode_reference(
        vc, enc.v_codebook, enc.rotation, unbiased=enc.value_unbiased
    )
    if enc.qjl is not None:
        resid = kc - polar_decode_reference(out["k_codes"], out["k_norms"], enc.k_codebook, enc.rotation)
        sketch = qjl_encode(resid if keep is None else resid * keep, enc.qjl)
        out["k_qjl"], out["k_qjl_norms"] = sketch.signs, sketch.norms
    return out
