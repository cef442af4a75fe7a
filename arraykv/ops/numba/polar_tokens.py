"""Numba kernel of :func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference`.

One compiled call centres and weights the keys (plain or rotating mean: the angle of each
turning pair formed in float64 and its cosine and sine rounded to float32, as the reference
does), cuts out the outlier channels, centres the values, and encodes both with the
TurboQuant-MSE loop of :mod:`arraykv.ops.numba.polar` (on the calling thread for a decode
step's one token, over Numba's threads for a long prefill's spill). Results equal the reference except where
float rounding puts a rotated coordinate on the other side of a threshold.
"""

from __future__ import annotations

import math

import numpy as np

try:
    import numba as nb
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

from .polar import _encode_par, _encode_ser, _host, _matrix
from .polar_rows import HALF_TO_FLOAT, _bits16, memo_by_objects
from .threads import launch, threads_for

__all__ = ["polar_encode_tokens"]

_NO_F32_3 = np.zeros((0, 0, 0), np.float32)
_NO_I32_2 = np.zeros((0, 2), np.int32)


@nb.njit(cache=True, nogil=True)
def _center(k, v, start, k_mean, v_mean, k_scale, idx, freq, pairs, half, kc, vc, k_out):
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
                mean[j] = half[k_mean[b, h, j]]
                weight[j] = half[k_scale[b, h, j]]
                v_mu[j] = half[v_mean[b, h, j]]
            for t in range(t_n):
                r = (b * h_n + h) * t_n + t
                if rotating:
                    p = np.float64(start + t)
                    for j in range(n_j):
                        a = pairs[j, 0]
                        c = pairs[j, 1]
                        ma = half[k_mean[b, h, a]]
                        mb = half[k_mean[b, h, c]]
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


#: Host tables of a cache's rotation and codebooks, by their ids (:func:`memo_by_objects`).
_FIXED: dict = {}


def _make_fixed(rotation, k_codebook, v_codebook) -> tuple:
    return (_host(rotation.signs), _matrix(rotation), rotation.kind == "hadamard",
            *((_host(b.thresholds), _host(b.centroids), int(b.bits)) for b in (k_codebook, v_codebook)))


def _fixed(rotation, k_codebook, v_codebook) -> tuple:
    """``(signs, matrix, hadamard, (k_thr, k_cent, k_bits), (v_thr, v_cent, v_bits))`` as the encoder takes them."""
    return memo_by_objects(_FIXED, (rotation, k_codebook, v_codebook), _make_fixed)


def polar_encode_tokens(k, v, k_mean, v_mean, k_scale, k_outlier_idx, k_mean_freq, k_mean_pairs, start, k_codebook,
                        v_codebook, rotation, key_unbiased, value_unbiased):
    """Kernel of :func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference` (same arguments and result)."""
    k = np.asarray(k, np.float32)
    v = np.asarray(v, np.float32)
    b, h, t, d = k.shape
    n = b * h * t
    idx = np.asarray(k_outlier_idx, np.int32)
    n_out = idx.shape[2]
    if k_mean_freq is None:
        freq, pairs = _NO_F32_3, _NO_I32_2
    else:
        freq = np.asarray(k_mean_freq, np.float32)
        pairs = np.ascontiguousarray(k_mean_pairs, np.int32)
    signs, matrix, hadamard, k_tabs, v_tabs = _fixed(rotation, k_codebook, v_codebook)
    kc = np.empty((n, d), np.float32)
    vc = np.empty((n, d), np.float32)
    k_out = np.empty((n, n_out), np.float32)
    _center(k, v, int(start), _bits16(k_mean), _bits16(v_mean), _bits16(k_scale), idx, freq, pairs, HALF_TO_FLOAT,
            kc, vc, k_out)
    out = {}
    for name, x, (thr, cent, bits), unbiased in (("k", kc, k_tabs, key_unbiased), ("v", vc, v_tabs, value_unbiased)):
        codes = np.empty((n, (d * bits + 7) // 8), np.uint8)
        lengths = np.empty(n, np.float32)
        args = (x, signs, matrix, hadamard, thr, cent, bits, bool(unbiased), codes, lengths)
        if threads_for(x.size) == 1:
            _encode_ser(*args)
        else:  # a long prefill's spill
            with launch(x.size):
                _encode_par(*args)
        out[f"{name}_codes"] = codes.reshape(b, h, t, -1)
        out[f"{name}_norms"] = lengths.astype(np.float16).reshape(b, h, t)
    if n_out:
        out["k_outliers"] = k_out.astype(np.float16).reshape(b, h, t, n_out)
    return out
