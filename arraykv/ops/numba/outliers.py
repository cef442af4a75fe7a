"""Numba kernel for the dense-and-sparse split of :mod:`arraykv.quant.outliers`.

The array-API reference makes about seven passes over the tensor (mean, the three passes of
``std``, ``|x - μ|``, the comparison, ``nonzero``) and allocates a float32 copy and two
temporaries of its size. Here the statistics take two read-only passes per head (the mean,
then the centred sum of squares, both accumulated in float64), a third counts the outliers,
and only when there are any does a fourth write the dense copy and the side table. Without
outliers, the usual case, a float32 input is returned as the dense part without a copy.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ...quant.outliers import SparseOutliers
from .threads import launch

__all__ = ["split_outliers"]


@nb.njit(cache=True, nogil=True, parallel=True)
def _stats(x, thr, mu, sd, counts):
    """Per (head, channel) mean and population std over (batch, seq); outliers per head."""
    b, h, s, d = x.shape
    n = b * s
    for hh in nb.prange(h):
        acc = np.zeros(d, np.float64)
        for bb in range(b):
            for t in range(s):
                for c in range(d):
                    acc[c] += x[bb, hh, t, c]
        m64 = acc / n
        m32 = np.empty(d, np.float32)
        for c in range(d):
            m32[c] = np.float32(m64[c])
            acc[c] = 0.0
        for bb in range(b):
            for t in range(s):
                for c in range(d):
                    e = np.float64(x[bb, hh, t, c]) - m64[c]
                    acc[c] += e * e
        lim = np.empty(d, np.float32)
        for c in range(d):
            sd32 = np.float32(np.sqrt(acc[c] / n))
            mu[hh, c] = m32[c]
            sd[hh, c] = sd32
            lim[c] = thr * sd32
        cnt = 0
        for bb in range(b):
            for t in range(s):
                for c in range(d):
                    if abs(np.float32(x[bb, hh, t, c]) - m32[c]) > lim[c]:
                        cnt += 1
        counts[hh] = cnt


@nb.njit(cache=True, nogil=True)
def _split(x, thr, mu, sd, dense, index):
    """Write the dense part (outliers replaced by their channel mean) and the side table."""
    b, h, s, d = x.shape
    j = 0
    for bb in range(b):
        for hh in range(h):
            for t in range(s):
                base = ((bb * h + hh) * s + t) * d
                for c in range(d):
                    x32 = np.float32(x[bb, hh, t, c])
                    if abs(x32 - mu[hh, c]) > thr * sd[hh, c]:
                        index[j] = base + c
                        j += 1
                        dense[bb, hh, t, c] = mu[hh, c]
                    else:
                        dense[bb, hh, t, c] = x32


def split_outliers(x: np.ndarray, threshold: float):
    """Kernel of :func:`arraykv.quant.outliers.split_outliers_reference` for NumPy arrays.

    Parameters
    ----------
    x : ndarray of float16/float32/float64, shape (batch, heads, seq, head_dim)
    threshold : float

    Returns
    -------
    dense : ndarray of float32, same shape (``x`` itself when it is float32, C-contiguous
        and has no outlier)
    outliers : SparseOutliers
        ``index`` int32 (int64 from 2**31 values), shape (count,), ascending flat positions;
        ``value`` of x.dtype, shape (count,).

    Notes
    -----
    The mean and standard deviation are accumulated in float64, so they can differ from the
    float32 reference in the last bit; the test ``|x − μ| > threshold·σ`` is done in float32
    as in the reference. A value within one float32 ulp of the boundary may therefore fall on
    the other side than in the reference; both are valid splits (the outliers are restored
    exactly either way).
    """
    b, h, s, d = (int(t) for t in x.shape)
    x = np.ascontiguousarray(x)
    given = x
    if x.dtype not in (np.float32, np.float64):  # float16: widened exactly, the kernels read float32/64
        x = x.astype(np.float32)
    thr = np.float32(threshold)
    mu = np.empty((h, d), np.float32)
    sd = np.empty((h, d), np.float32)
    counts = np.zeros(h, np.int64)
    with launch(x.size):
        _stats(x, thr, mu, sd, counts)
    count = int(counts.sum())
    idx_dtype = np.int32 if x.size < 2**31 else np.int64
    index = np.empty(count, idx_dtype)
    if count == 0:
        dense = x if x.dtype == np.float32 else x.astype(np.float32)
        return dense, SparseOutliers(index=index, value=given.reshape(-1)[:0].copy())
    dense = np.empty(x.shape, np.float32)
    _split(x, thr, mu, sd, dense, index)
    return dense, SparseOutliers(index=index, value=given.reshape(-1)[index])
