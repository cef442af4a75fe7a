"""Low-rank projection of per-head vectors onto a PCA/SVD basis.

A basis is fitted per head (or shared by all heads of a layer) from the vectors being
compressed or from calibration data, then vectors are stored as ``rank`` coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._types import Array, DType
from .._validation import check_float_array, check_int, check_real
from ._dims import axis_length

__all__ = [
    "LowRankBasis",
    "LowRankLayerCoefficients",
    "fit_basis",
    "project",
    "reconstruct",
    "eckart_young_error",
    "choose_rank",
]


@dataclass(frozen=True)
class LowRankBasis:
    """An orthonormal basis per head and the mean it is centred on.

    Attributes
    ----------
    basis : array of float32, shape (heads, head_dim, rank)
        Orthonormal columns: the leading principal directions of each head.
    mean : array of float32, shape (heads, head_dim), or None
        Subtracted before projecting (None when fitted uncentred).
    variance : array of float32, shape (heads, head_dim)
        Variance along every principal direction (eigenvalues of the covariance, descending),
        for inspection and for choosing a rank by energy.
    rank : int
    """

    basis: Array
    mean: Array
    variance: Array
    rank: int

    heads = axis_length("basis", 0)
    head_dim = axis_length("basis", 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the basis and mean (what a compressed tensor must carry to be decoded)."""
        total = _compat.array_nbytes(self.basis)
        if self.mean is not None:
            total += _compat.array_nbytes(self.mean)
        return total

    def energy_kept(self) -> Array:
        """Fraction of the variance that the kept directions hold, per head: array (heads,)."""
        xp = _compat.namespace(self.variance)
        total = xp.sum(self.variance, axis=-1)
        kept = xp.sum(self.variance[:, : self.rank], axis=-1)
        return kept / xp.where(total > 0.0, total, 1.0)


@dataclass(frozen=True)
class LowRankLayerCoefficients:
    """A low-rank layer's encoded tokens and bases: what the fused decode attention reads besides the query.

    The argument object of :func:`arraykv.ops.lowrank_decode_attention`, its array-API reference
    (:func:`arraykv.attention.lowrank_fused.lowrank_decode_attention`) and its Numba kernel
    (:mod:`arraykv.ops.numba.lowrank_fused`), built per step by
    :class:`~arraykv.caches.lowrank.LowRankCache`: token ``t``'s key is ``k_mean + k_basis @
    k_coef[..., t, :]``, its value likewise. It holds references, never copies; shapes are
    checked by the ops (:func:`arraykv.attention.lowrank_fused.check_decode_args`).

    Attributes
    ----------
    k_coef, v_coef : array of float16 or float32, shape (batch, h, T, r_k) and (batch, h, T, r_v)
        Coefficients of the ``T`` encoded tokens (``T`` may be 0).
    k_basis, v_basis : array of float32, shape (h, head_dim, r_k) and (h, head_dim, r_v), or None
        Orthonormal columns (:attr:`LowRankBasis.basis`); None, and ignored, when ``T = 0``.
    k_mean, v_mean : array of float32, shape (h, head_dim), or None
        The means the coefficients are centred on; None, and ignored, when ``T = 0``.
    """

    k_coef: Array
    k_basis: Array
    k_mean: Array
    v_coef: Array
    v_basis: Array
    v_mean: Array


def choose_rank(variance: Array, energy: float) -> int:
    """Fewest leading directions holding at least ``energy`` of the variance, in every head.

    Parameters
    ----------
    variance : array, shape (heads, head_dim), descending along the last axis
    energy : float in (0, 1]

    Returns
    -------
    int
        The largest per-head rank, so that one rectangular array serves all heads.
    """
    xp = _compat.namespace(variance)
    total = xp.sum(variance, axis=-1, keepdims=True)
    frac = xp.cumulative_sum(variance, axis=-1) / xp.where(total > 0.0, total, 1.0)
    # Directions needed = 1 + number of prefixes still below the target.
    below = xp.sum(xp.astype(frac < (energy - 1e-7), xp.int32), axis=-1)
    d = int(variance.shape[-1])
    return min(d, int(xp.max(below)) + 1)


def fit_basis(
    x: Array, *, rank: int | None = None, energy: float | None = None, center: bool = True, per_head: bool = True
) -> LowRankBasis:
    """Fit the principal directions of ``x`` per head.

    Parameters
    ----------
    x : array of float, shape (heads, n, head_dim)
        ``n`` sample vectors per head (tokens of every batch row).
    rank : int, optional
        Directions to keep, ``1 <= rank <= head_dim``.
    energy : float, optional
        Keep the fewest directions holding at least this fraction of the variance
        (``0 < energy <= 1``). Exactly one of ``rank`` and ``energy`` must be given.
    center : bool, default True
        Subtract the per-head mean first (PCA). ``False`` gives the uncentred SVD basis.
    per_head : bool, default True
        One basis per head; ``False`` fits one basis on all heads together and repeats it.

    Returns
    -------
    LowRankBasis

    Notes
    -----
    For centred samples ``X`` (n × d) with covariance ``C = XᵀX / n = V Λ Vᵀ`` (``eigh``), the
    right singular vectors of ``X`` are the columns of ``V``. By the Eckart–Young–Mirsky theorem
    the rank-``r`` truncation ``X V_r V_rᵀ`` is the best rank-``r`` approximation of ``X`` in
    Frobenius norm, with squared error ``n Σ_{i>r} λ_i``; adding the mean makes it the best
    rank-``r`` affine approximation, which is never worse than the best linear one of the
    uncentred data. The d × d Gram matrix of the centred data is formed in float32 with one
    matmul (BLAS), then decomposed with ``eigh`` in float64; the float32 accumulation error is
    far below the 1% tolerance against the exact SVD truncation that the tests check.
    """
    xp = _compat.namespace(x)
    check_float_array(xp, "x", x, "(heads, n, head_dim)")
    h, n, d = (int(s) for s in x.shape)
    if n < 1:
        raise ValueError("x must hold at least one sample vector per head (axis 1), received 0")
    rank, energy = check_rank_energy(rank, energy, d)
    x32 = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
    if not per_head:
        x32 = xp.reshape(x32, (1, h * n, d))
    mean: Array = xp.mean(x32, axis=1) if center else None
    xc = x32 - mean[:, None, :] if center else x32
    gram = xp.astype(xp.matmul(xp.matrix_transpose(xc), xc), xp.float64) / float(xc.shape[1])
    evals, evecs = xp.linalg.eigh(gram)
    evals = xp.flip(evals, axis=-1)
    evecs = xp.flip(evecs, axis=-1)
    evals = xp.where(evals > 0.0, evals, 0.0)
    if rank is None:
        rank = choose_rank(evals, energy)
    basis = xp.astype(evecs[:, :, :rank], xp.float32)
    variance = xp.astype(evals, xp.float32)
    mean32 = mean
    if not per_head:
        basis = xp.broadcast_to(basis, (h, d, rank))
        basis = xp.asarray(basis, copy=True)
        variance = xp.asarray(xp.broadcast_to(variance, (h, d)), copy=True)
        if mean32 is not None:
            mean32 = xp.asarray(xp.broadcast_to(mean32, (h, d)), copy=True)
    return LowRankBasis(basis=basis, mean=mean32, variance=variance, rank=int(rank))


def check_rank_energy(rank: Any, energy: Any, head_dim: int) -> tuple:
    """Validate the ``rank`` / ``energy`` pair; return ``(rank or None, energy or None)``."""
    if (rank is None) == (energy is None):
        raise ValueError(f"give exactly one of rank and energy, received rank={rank!r}, energy={energy!r}")
    if rank is not None:
        return check_int("rank", rank, low=1, high=head_dim), None
    return None, check_real("energy", energy, low=0.0, high=1.0, low_open=True)


def row_products(x: Array, w: Array) -> Array:
    """``x @ w`` with every output row summed in one fixed order, whatever the number of rows.

    Parameters
    ----------
    x : array of float32, shape (..., seq, d)
    w : array of float32, shape (..., d, r), broadcast against ``x``'s leading axes

    Returns
    -------
    array of float32, shape (..., seq, r)

    Notes
    -----
    A BLAS matrix product blocks its sums by the matrix's shape, so the coefficients of a
    token could differ in the last bit between a call of 1 token and one of 9; a cache whose
    truncation promises the state of a direct build needs every token's code to depend on
    that token alone. Here element ``(t, j)`` is ``((x[t,0] w[0,j] + x[t,1] w[1,j]) + ...)``,
    one multiply-add per channel in channel order (``d`` elementwise passes).
    """
    d = int(x.shape[-1])
    out = x[..., :, 0:1] * w[..., None, 0, :]
    for i in range(1, d):
        out = out + x[..., :, i : i + 1] * w[..., None, i, :]
    return out


def project(x: Array, b: LowRankBasis) -> Array:
    """Coefficients ``(x - mean) @ basis``.

    Parameters
    ----------
    x : array, shape (..., heads, seq, head_dim)
    b : LowRankBasis

    Returns
    -------
    array of float32, shape (..., heads, seq, rank)
    """
    xp = _compat.namespace(x)
    x32 = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
    if b.mean is not None:
        x32 = x32 - b.mean[:, None, :]
    return xp.matmul(x32, b.basis)


def reconstruct(coeffs: Array, b: LowRankBasis, dtype: DType | None = None) -> Array:
    """``coeffs @ basisᵀ + mean``: array (..., heads, seq, head_dim) in ``dtype`` (default float32)."""
    xp = _compat.namespace(coeffs)
    out = xp.matmul(coeffs, xp.matrix_transpose(b.basis))
    if b.mean is not None:
        out = out + b.mean[:, None, :]
    if dtype is not None and out.dtype != dtype:
        out = xp.astype(out, dtype)
    return out


def eckart_young_error(x: Array, rank: int) -> float:
    """Relative error ``‖X - X_r‖_F / ‖X‖_F`` of the best rank-``rank`` approximation per head.

    ``x`` has shape (heads, n, head_dim); ``X_r`` is the truncated SVD of each head's
    (uncentred) matrix, computed with ``xp.linalg.svd`` in float64. The errors of all heads
    are pooled: ``sqrt(Σ_h ‖X_h - X_{h,r}‖² / Σ_h ‖X_h‖²)``.
    """
    xp = _compat.namespace(x)
    x64 = xp.astype(x, xp.float64)
    s = xp.linalg.svdvals(x64)
    tail = float(xp.sum(s[:, rank:] ** 2))
    total = float(xp.sum(s**2))
    return (tail / total) ** 0.5 if total > 0 else 0.0
