"""Numba kernel of :func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference`.

One compiled call centres and weights the keys (plain or rotating mean: the angle of each
turning pair formed in float64 and its cosine and sine rounded to float32, as the reference
does), cuts out the outlier channels, centres the values, and encodes both with the
TurboQuant-MSE loop of :mod:`arraykv.ops.numba.polar.codec` (on the calling thread for a decode
step's one token, over Numba's threads for a long prefill's spill). With a QJL sketch (``tq``
caches) the keys are decoded back from their codes and the residual's signs under the sketch
are packed in the same call. Results equal the reference except where float rounding puts a
rotated coordinate on the other side of a threshold (or a sketched residual on the other side of 0).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from ..half import HALF_TO_FLOAT, half_to_float
from ..threads import launch, threads_for
from .codec import decode_par, decode_ser, encode_par, encode_ser, host_array, rotation_matrix
from .rows import bits16, memo_by_objects

__all__ = ["polar_encode_tokens", "encoder_args", "center", "sketch_stored"]

_NO_F32_3 = np.zeros((0, 0, 0), np.float32)
_NO_I32_2 = np.zeros((0, 2), np.int32)


@nb.njit(cache=True, nogil=True)
def center(k, v, start, k_mean, v_mean, k_scale, idx, freq, pairs, half, kc, vc, k_out):
    """``kc``, ``vc`` (N, d) float32 and ``k_out`` (N, n_out) of tokens ``k``, ``v`` (b, h, t, d)."""
    b_n, h_n, t_n, d = k.shape
    n_out = idx.shape[2]
    n_j = pairs.shape[0]
    rotating = freq.shape[2] > 0
    mean = np.empty(d, np.float32)
    weight = np.empty(d, np.float32)
    v_mu = np.empty(d, np.float32)
    for b in range(b_n):
        for h in range(h_n):
            # the head's calibration once; a rotating mean overwrites its pairs' channels per token
            for j in range(d):
                mean[j] = half_to_float(k_mean[b, h, j], half)
                weight[j] = half_to_float(k_scale[b, h, j], half)
                v_mu[j] = half_to_float(v_mean[b, h, j], half)
            for t in range(t_n):
                r = (b * h_n + h) * t_n + t
                if rotating:
                    p = np.float64(start + t)
                    for j in range(n_j):
                        a = pairs[j, 0]
                        c = pairs[j, 1]
                        ma = half_to_float(k_mean[b, h, a], half)
                        mb = half_to_float(k_mean[b, h, c], half)
                        ang = np.float64(freq[b, h, j]) * p
                        cs = np.float32(math.cos(ang))
                        sn = np.float32(math.sin(ang))
                        mean[a] = ma * cs - mb * sn
                        mean[c] = mb * cs + ma * sn
                for j in range(d):
                    kc[r, j] = (k[b, h, t, j] - mean[j]) * weight[j]
                    vc[r, j] = v[b, h, t, j] - v_mu[j]
                for o in range(n_out):
                    ch = idx[b, h, o]
                    k_out[r, o] = kc[r, ch]
                    kc[r, ch] = np.float32(0.0)


@nb.njit(cache=True, nogil=True)
def _encode_tokens_ser(
    k,
    v,
    start,
    k_mean,
    v_mean,
    k_scale,
    idx,
    freq,
    pairs,
    half,
    kc,
    vc,
    k_out,
    signs,
    matrix,
    hadamard,
    k_thr,
    k_cent,
    k_bits,
    k_unbiased,
    k_codes,
    k_lengths,
    v_thr,
    v_cent,
    v_bits,
    v_unbiased,
    v_codes,
    v_lengths,
):
    """:func:`center`, then both TurboQuant-MSE encodes, on the calling thread (one call per decode step)."""
    center(k, v, start, k_mean, v_mean, k_scale, idx, freq, pairs, half, kc, vc, k_out)
    encode_ser(kc, signs, matrix, hadamard, k_thr, k_cent, k_bits, k_unbiased, k_codes, k_lengths)
    encode_ser(vc, signs, matrix, hadamard, v_thr, v_cent, v_bits, v_unbiased, v_codes, v_lengths)


@nb.njit(cache=True, nogil=True)
def sketch_stored(
    k_codes, k_norms, signs, matrix, hadamard, cent, bits, kc, idx, heads, tokens, sketch_t, kd, packed, norms
):
    """The QJL part of a decode step's encode in one call: the keys decoded back from their codes
    and float16 lengths ``k_norms`` (uint16 bits), then :func:`_sketch_residual`."""
    lengths = np.empty(k_norms.shape[0], np.float32)
    for i in range(lengths.shape[0]):
        lengths[i] = half_to_float(k_norms[i], None)
    decode_ser(k_codes, lengths, signs, matrix, hadamard, cent, bits, kd)
    _sketch_residual(kc, kd, idx, heads, tokens, sketch_t, packed, norms)


@nb.njit(cache=True, nogil=True)
def _sketch_residual(kc, kd, idx, heads, tokens, matrix_t, signs, norms):
    """Packed signs (N, ceil(m / 8)) and float32 norms (N,) of the residuals ``kc − kd`` (N, d),
    zero on each row's outlier channels ``idx[b, h]``, under the sketch ``S`` given transposed,
    ``matrix_t`` = ``Sᵀ`` (d, m).

    Sign ``i`` (``S r ≥ 0``) is bit ``i % 8`` of byte ``i // 8``, the layout of
    :func:`arraykv.quant.bitpack.pack_bits` with one bit per code. ``S r`` is summed over the
    channels in order for every row of ``S`` at once (rows of ``Sᵀ``, whole vectors).
    """
    n, d = kc.shape
    m = matrix_t.shape[1]
    r = np.empty(d, np.float32)
    x = np.empty(m, np.float32)
    for row in range(n):
        bh = row // tokens
        for j in range(d):
            r[j] = kc[row, j] - kd[row, j]
        for o in range(idx.shape[2]):
            r[idx[bh // heads, bh % heads, o]] = np.float32(0.0)
        ss = np.float32(0.0)
        for j in range(d):
            ss += r[j] * r[j]
        norms[row] = np.float32(math.sqrt(ss))
        for i in range(m):
            x[i] = np.float32(0.0)
        for j in range(d):
            rj = r[j]
            for i in range(m):
                x[i] += matrix_t[j, i] * rj
        for byte in range(signs.shape[1]):
            signs[row, byte] = 0
        for i in range(m):
            if x[i] >= 0.0:
                signs[row, i >> 3] |= np.uint8(1 << (i & 7))


#: Host tables of a cache's rotation and codebooks, by their ids (:func:`memo_by_objects`).
_FIXED: dict = {}


def _make_fixed(rotation, k_codebook, v_codebook, qjl) -> tuple:
    return (
        host_array(rotation.signs),
        rotation_matrix(rotation),
        rotation.kind == "hadamard",
        *((host_array(b.thresholds), host_array(b.centroids), int(b.bits)) for b in (k_codebook, v_codebook)),
        None if qjl is None else np.ascontiguousarray(host_array(qjl.matrix).T),
    )


def _fixed(rotation, k_codebook, v_codebook, qjl) -> tuple:
    """``(signs, matrix, hadamard, (k_thr, k_cent, k_bits), (v_thr, v_cent, v_bits), sketch_t)`` as the
    encoder takes them (``sketch_t`` the QJL matrix transposed, (d, m) float32, or None)."""
    return memo_by_objects(_FIXED, (rotation, k_codebook, v_codebook, qjl), _make_fixed)


def _run(serial, parallel, x, *args):
    """``serial(x, *args)`` on this thread for a decode step, ``parallel`` over Numba's threads for a long spill."""
    if threads_for(x.size) == 1:
        serial(x, *args)
    else:
        with launch(x.size):
            parallel(x, *args)


#: :func:`encoder_args` of the encoders in use, by their ids (the entries keep the encoders).
_ENCODERS: dict = {}
#: Entries of :data:`_ENCODERS` (a cache makes one encoder per calibrated layer).
_ENCODERS_MAX = 1024


def encoder_args(enc) -> tuple:
    """A :class:`~arraykv.quant.polar_encoder.PolarEncoder` unpacked into what the kernels take, in
    one place: ``(calib, fixed, key_unbiased, value_unbiased)``.

    ``calib`` is the calibration as :func:`center` takes it (``k_mean``, ``v_mean``,
    ``k_scale`` as uint16 views, the outlier channels int32, the rotating mean's frequencies and
    pairs, empty arrays for a plain mean, and the float16 table); ``fixed`` is :func:`_fixed`'s
    tuple of the rotation, codebooks and sketch. Memoised by the encoder object (a cache keeps
    one per layer calibration: its decode steps unpack it once).
    """
    return memo_by_objects(_ENCODERS, (enc,), _encoder_args, _ENCODERS_MAX)


def _encoder_args(enc) -> tuple:
    if enc.k_mean_freq is None:
        freq, pairs = _NO_F32_3, _NO_I32_2
    else:
        freq = np.asarray(enc.k_mean_freq, np.float32)
        pairs = np.ascontiguousarray(enc.k_mean_pairs, np.int32)
    calib = (
        bits16(enc.k_mean),
        bits16(enc.v_mean),
        bits16(enc.k_scale),
        np.asarray(enc.k_outlier_idx, np.int32),
        freq,
        pairs,
        HALF_TO_FLOAT,
    )
    fixed = _fixed(enc.rotation, enc.k_codebook, enc.v_codebook, enc.qjl)
    return calib, fixed, bool(enc.key_unbiased), bool(enc.value_unbiased)


def polar_encode_tokens(k, v, enc, start):
    """Kernel of :func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference` (same arguments and result)."""
    k = np.asarray(k, np.float32)
    v = np.asarray(v, np.float32)
    b, h, t, d = k.shape
    n = b * h * t
    calib, (signs, matrix, hadamard, k_tabs, v_tabs, sketch_t), key_unbiased, value_unbiased = encoder_args(enc)
    idx = calib[3]
    n_out = idx.shape[2]
    kc = np.empty((n, d), np.float32)
    vc = np.empty((n, d), np.float32)
    k_out = np.empty((n, n_out), np.float32)
    k_codes, v_codes = (np.empty((n, (d * tabs[2] + 7) // 8), np.uint8) for tabs in (k_tabs, v_tabs))
    k_len = np.empty(n, np.float32)
    v_len = np.empty(n, np.float32)
    serial = threads_for(kc.size) == 1  # a decode step: on this thread, few calls
    if serial:  # centring and both encodes in one call
        _encode_tokens_ser(
            k,
            v,
            int(start),
            *calib,
            kc,
            vc,
            k_out,
            signs,
            matrix,
            hadamard,
            *k_tabs,
            key_unbiased,
            k_codes,
            k_len,
            *v_tabs,
            value_unbiased,
            v_codes,
            v_len,
        )
    else:
        center(k, v, int(start), *calib, kc, vc, k_out)
        _run(encode_ser, encode_par, kc, signs, matrix, hadamard, *k_tabs, key_unbiased, k_codes, k_len)
        _run(encode_ser, encode_par, vc, signs, matrix, hadamard, *v_tabs, value_unbiased, v_codes, v_len)
    k_norms = k_len.astype(np.float16)
    out = {"k_codes": k_codes.reshape(b, h, t, -1), "k_norms": k_norms.reshape(b, h, t)}
    if sketch_t is not None:  # the residual of the key as stored (float16 length)
        kd = np.empty((n, d), np.float32)
        packed = np.empty((n, (sketch_t.shape[1] + 7) // 8), np.uint8)
        norms = np.empty(n, np.float32)
        if serial:
            sketch_stored(
                k_codes,
                k_norms.view(np.uint16),
                signs,
                matrix,
                hadamard,
                k_tabs[1],
                k_tabs[2],
                kc,
                idx,
                h,
                t,
                sketch_t,
                kd,
                packed,
                norms,
            )
        else:
            _run(
                decode_ser,
                decode_par,
                k_codes,
                k_norms.astype(np.float32),
                signs,
                matrix,
                hadamard,
                k_tabs[1],
                k_tabs[2],
                kd,
            )
            _sketch_residual(kc, kd, idx, h, t, sketch_t, packed, norms)
        out["k_qjl"] = packed.reshape(b, h, t, -1)
        out["k_qjl_norms"] = norms.astype(np.float16).reshape(b, h, t)
    out["v_codes"] = v_codes.reshape(b, h, t, -1)
    out["v_norms"] = v_len.astype(np.float16).reshape(b, h, t)
    if n_out:
        out["k_outliers"] = k_out.astype(np.float16).reshape(b, h, t, n_out)
    return out
