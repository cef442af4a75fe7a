"""Dense-and-sparse split: outliers kept exactly in a sparse side table.

Rule
----
Per (head, channel), over every token of every batch row, compute the mean ``μ`` and the
standard deviation ``σ``. A value ``x`` is an outlier when ``|x - μ| > threshold * σ``.
Outliers are stored exactly (flat index + value in the input dtype) and replaced by ``μ`` in
the dense part, which is then compressed; decompression overwrites their positions with the
stored values, so they come back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _compat
from .._types import Array

__all__ = ["SparseOutliers", "split_outliers", "split_outliers_reference", "scatter_outliers"]


@dataclass(frozen=True)
class SparseOutliers:
    """Outliers of a (batch, heads, seq, head_dim) tensor.

    Attributes
    ----------
    index : array of int32 or int64, shape (count,)
        Flat (C-order) positions, ascending.
    value : array, shape (count,)
        The exact values, in the input dtype.
    """

    index: Array
    value: Array

    @property
    def count(self) -> int:
        return int(self.index.shape[0])

    @property
    def nbytes(self) -> int:
        return _compat.array_nbytes(self.index) + _compat.array_nbytes(self.value)


def split_outliers(x: Array, threshold: float) -> tuple[Array, SparseOutliers]:
    """Split ``x`` (batch, heads, seq, head_dim) into a dense float32 part and sparse outliers.

    Parameters
    ----------
    x : array of float
    threshold : float
        Outlier rule ``|x - μ| > threshold * σ`` per (head, channel) (see the module notes).

    Returns
    -------
    dense : array of float32, same shape, outliers replaced by their channel mean
    outliers : SparseOutliers

    Notes
    -----
    The dense-and-sparse decomposition of SqueezeLLM (Kim et al., 2023) keeps the few
    values that would stretch a quantizer's range in a sparse full-precision table; the
    rest is compressed densely. A z-score rule is used instead of a fixed fraction because
    it needs no sort (one pass for the statistics, one for the test). On Gaussian data at
    ``threshold = 6`` the expected fraction of outliers is 2e-9. Array-API code;
    ``arraykv.ops.split_outliers`` is the same function with a kernel per namespace.
    """
    return split_outliers_reference(x, threshold)


def split_outliers_reference(x: Array, threshold: float) -> tuple[Array, SparseOutliers]:
    """Array-API form of :func:`split_outliers` (the reference its kernels are tested against)."""
    xp = _compat.namespace(x)
    x32 = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
    mu = xp.mean(x32, axis=(0, 2), keepdims=True)
    sd = xp.std(x32, axis=(0, 2), keepdims=True)
    mask = xp.abs(x32 - mu) > float(threshold) * sd
    flat = xp.reshape(mask, (-1,))
    index = xp.nonzero(flat)[0]
    total = int(flat.shape[0])
    if total < 2**31:
        index = xp.astype(index, xp.int32)
    value = xp.take(xp.reshape(x, (-1,)), xp.astype(index, xp.int64), axis=0)
    if int(index.shape[0]):
        dense = xp.where(mask, mu, x32)
    else:
        dense = x32
    return dense, SparseOutliers(index=index, value=value)


def scatter_outliers(y: Array, outliers: SparseOutliers) -> Array:
    """Write ``outliers.value`` into a copy of ``y`` at ``outliers.index`` (flat positions)."""
    if outliers.count == 0:
        return y
    xp = _compat.namespace(y)
    shape = tuple(int(s) for s in y.shape)
    flat = xp.reshape(y, (-1,))
    vals = xp.astype(outliers.value, y.dtype)
    idx = xp.astype(outliers.index, xp.int64)
    if _compat.is_numpy(xp) or _compat.is_cupy(xp):
        flat = xp.asarray(flat, copy=True)
        flat[idx] = vals  # integer-array assignment: NumPy and CuPy have it, the standard does not
        return xp.reshape(flat, shape)
    return xp.reshape(scatter_reference(flat, idx, vals), shape)


def scatter_reference(flat: Array, idx: Array, vals: Array) -> Array:
    """Array-API scatter: ``flat[idx] = vals`` for ascending ``idx``, via ``searchsorted``."""
    xp = _compat.namespace(flat)
    n = int(flat.shape[0])
    m = int(idx.shape[0])
    pos = xp.arange(n, dtype=idx.dtype, device=_compat.device(flat))
    j = xp.searchsorted(idx, pos)
    jc = xp.clip(j, 0, m - 1)
    hit = (j < m) & (xp.take(idx, jc, axis=0) == pos)
    return xp.where(hit, xp.take(vals, jc, axis=0), flat)
