"""Numba kernel of :func:`arraykv.quant.polar_store.polar_store_token_reference`.

A decode step of a polar layer whose sinks and window are full, as one compiled call: the
leaving window row read from its float16 bits, centred, weighted and encoded
(:func:`arraykv.ops.numba.polar.tokens.center` and the TurboQuant-MSE loop), the codes, float16
lengths and outlier channels written straight into the token buffers' row ``at``, for a ``tq``
key the residual sketch of the key as stored (decoded from the float16 length just written, as
the encode does: :func:`arraykv.ops.numba.polar.tokens.sketch_stored`),
and the new token rounded to float16 into the window row ``arriving``. float16 results are
rounded in the kernel (:func:`arraykv.ops.numba.half.float_to_half`, NumPy's rounding) and
checked there for overflow, so the step allocates no NumPy array and returns whether the
cache may commit it. Results are those of the cache's general path bit for bit (the same
compiled encode, the same rounding).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..half import float_to_half, half_is_finite, half_to_float
from .codec import encode_ser
from .rows import bits16
from .tokens import center, encoder_args, sketch_stored

__all__ = ["polar_store_token"]

# placeholders for arrays a layer does not have (writable: the kernel's signature writes them)
_NO_SKETCH = np.zeros((0, 0), np.float32)
_NO_ROWS_U8 = np.zeros((0, 0, 0, 0), np.uint8)
_NO_ROWS_U16_3 = np.zeros((0, 0, 0), np.uint16)
_NO_ROWS_U16_4 = np.zeros((0, 0, 0, 0), np.uint16)


@nb.njit(cache=True, nogil=True)
def _store_token(
    k,
    v,
    wk,
    wv,
    leaving,
    arriving,
    start,
    k_mean,
    v_mean,
    k_scale,
    idx,
    freq,
    pairs,
    half,
    signs,
    matrix,
    hadamard,
    k_thr,
    k_cent,
    k_bits,
    k_unbiased,
    v_thr,
    v_cent,
    v_bits,
    v_unbiased,
    sketch_t,
    r_kc,
    r_kn,
    r_vc,
    r_vn,
    r_ko,
    r_kq,
    r_kqn,
    at,
):
    """The step on uint16 views of the float16 arrays; True when every float16 result is finite."""
    b_n, h_n, _, d = k.shape
    n = b_n * h_n
    n_out = idx.shape[2]
    old_k = np.empty((b_n, h_n, 1, d), np.float32)
    old_v = np.empty((b_n, h_n, 1, d), np.float32)
    for b in range(b_n):
        for h in range(h_n):
            for j in range(d):
                old_k[b, h, 0, j] = half_to_float(wk[b, h, leaving, j], half)
                old_v[b, h, 0, j] = half_to_float(wv[b, h, leaving, j], half)
    kc = np.empty((n, d), np.float32)
    vc = np.empty((n, d), np.float32)
    k_out = np.empty((n, n_out), np.float32)
    k_codes = np.empty((n, r_kc.shape[3]), np.uint8)
    v_codes = np.empty((n, r_vc.shape[3]), np.uint8)
    k_len = np.empty(n, np.float32)
    v_len = np.empty(n, np.float32)
    center(old_k, old_v, start, k_mean, v_mean, k_scale, idx, freq, pairs, half, kc, vc, k_out)
    encode_ser(kc, signs, matrix, hadamard, k_thr, k_cent, k_bits, k_unbiased, k_codes, k_len)
    encode_ser(vc, signs, matrix, hadamard, v_thr, v_cent, v_bits, v_unbiased, v_codes, v_len)
    finite = True
    k_stored = np.empty(n, np.uint16)  # the key lengths as stored (float16 bits), for the QJL residual
    for b in range(b_n):
        for h in range(h_n):
            r = b * h_n + h
            for c in range(k_codes.shape[1]):
                r_kc[b, h, at, c] = k_codes[r, c]
            for c in range(v_codes.shape[1]):
                r_vc[b, h, at, c] = v_codes[r, c]
            x = float_to_half(k_len[r])
            r_kn[b, h, at] = x
            k_stored[r] = x
            y = float_to_half(v_len[r])
            r_vn[b, h, at] = y
            finite &= half_is_finite(x) & half_is_finite(y)
            for o in range(n_out):
                x = float_to_half(k_out[r, o])
                r_ko[b, h, at, o] = x
                finite &= half_is_finite(x)
    if sketch_t.shape[0]:
        kd = np.empty((n, d), np.float32)
        packed = np.empty((n, r_kq.shape[3]), np.uint8)
        norms = np.empty(n, np.float32)
        sketch_stored(
            k_codes, k_stored, signs, matrix, hadamard, k_cent, k_bits, kc, idx, h_n, 1, sketch_t, kd, packed, norms
        )
        for b in range(b_n):
            for h in range(h_n):
                r = b * h_n + h
                for c in range(packed.shape[1]):
                    r_kq[b, h, at, c] = packed[r, c]
                x = float_to_half(norms[r])
                r_kqn[b, h, at] = x
                finite &= half_is_finite(x)
    for b in range(b_n):
        for h in range(h_n):
            for j in range(d):
                x = float_to_half(k[b, h, 0, j])
                y = float_to_half(v[b, h, 0, j])
                wk[b, h, arriving, j] = x
                wv[b, h, arriving, j] = y
                finite &= half_is_finite(x) & half_is_finite(y)
    return finite


def polar_store_token(k, v, window_k, window_v, leaving, arriving, enc, start, rows, at):
    """Kernel of :func:`arraykv.quant.polar_store.polar_store_token_reference` (same arguments and result)."""
    k = np.asarray(k, np.float32)
    v = np.asarray(v, np.float32)
    calib, (signs, matrix, hadamard, k_tabs, v_tabs, sketch_t), key_unbiased, value_unbiased = encoder_args(enc)
    outliers = rows.get("k_outliers")
    return bool(
        _store_token(
            k,
            v,
            bits16(window_k),
            bits16(window_v),
            int(leaving),
            int(arriving),
            int(start),
            *calib,
            signs,
            matrix,
            hadamard,
            *k_tabs,
            key_unbiased,
            *v_tabs,
            value_unbiased,
            _NO_SKETCH if sketch_t is None else sketch_t,
            rows["k_codes"],
            bits16(rows["k_norms"]),
            rows["v_codes"],
            bits16(rows["v_norms"]),
            _NO_ROWS_U16_4 if outliers is None else bits16(outliers),
            rows.get("k_qjl", _NO_ROWS_U8),
            bits16(rows.get("k_qjl_norms"), _NO_ROWS_U16_3),
            int(at),
        )
    )
