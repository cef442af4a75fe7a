"""QJL: 1-bit quantized Johnson–Lindenstrauss sketches, and TurboQuant-prod built on them.

``qjl_encode`` keeps ``sign(S r)`` (one bit per row of a seeded Gaussian matrix ``S``) and
``‖r‖``; ``⟨q, r⟩`` is then estimated without bias by ``√(π/2)/m · ‖r‖ · ⟨S q, sign(S r)⟩``.
``prod_encode`` is TurboQuant-prod: ``bits − 1`` bits of TurboQuant-MSE plus QJL of the
residual, an unbiased inner-product quantizer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .. import _compat
from .._types import Array, Device, Namespace
from .._validation import check_int, is_floating
from .bitpack import pack_bits, unpack_bits
from .codebooks import Codebook
from .polar import PolarCode, half_dtype, polar_decode, polar_encode
from .rotation import Rotation

__all__ = [
    "QJLSketch",
    "QJLCode",
    "ProdCode",
    "make_sketch",
    "qjl_encode",
    "qjl_decode",
    "qjl_inner",
    "prod_encode",
    "prod_decode",
    "QJL_SCALE",
]

#: ``√(π/2)``: ``E|⟨s, r⟩| = √(2/π) ‖r‖`` for a Gaussian row ``s``; its inverse unbiases the sketch.
QJL_SCALE = math.sqrt(math.pi / 2.0)


@dataclass(frozen=True)
class QJLSketch:
    """A seeded Gaussian sketch matrix.

    Attributes
    ----------
    matrix : array of float32, shape (m, dim)
        Rows are independent ``N(0, I)`` vectors.
    seed : int
    """

    matrix: Array
    seed: int

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[1])

    @property
    def rows(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def nbytes(self) -> int:
        return _compat.array_nbytes(self.matrix)

    @property
    def bits_per_value(self) -> float:
        return 0.0


@dataclass(frozen=True)
class QJLCode:
    """1-bit sketches of vectors.

    Attributes
    ----------
    signs : array of uint8, shape (..., ceil(m / 8))
        ``S r >= 0`` packed one bit per row (bit 1 = non-negative).
    norms : array of float16, shape (...)
        ``‖r‖``.
    rows : int
        ``m``.
    """

    signs: Array
    norms: Array
    rows: int

    @property
    def nbytes(self) -> int:
        return _compat.array_nbytes(self.signs) + _compat.array_nbytes(self.norms)

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / max(_count(self.norms) * self.rows, 1)


@dataclass(frozen=True)
class ProdCode:
    """TurboQuant-prod codes: an MSE part and a QJL sketch of its residual."""

    mse: PolarCode
    qjl: QJLCode

    @property
    def nbytes(self) -> int:
        return self.mse.nbytes + self.qjl.nbytes

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / max(_count(self.mse.norms) * self.mse.dim, 1)


def _count(a: Array) -> int:
    n = 1
    for s in a.shape:
        n *= int(s)
    return n


@functools.lru_cache(maxsize=32)
def _host_sketch(rows: int, dim: int, seed: int) -> Array:
    """Seeded Gaussian sketch generated on the host with NumPy (float32, read-only)."""
    np = _compat.host_numpy()  # host-side computation of a fixed table

    s = np.random.default_rng([seed, 0x51A]).standard_normal((rows, dim)).astype(np.float32)
    s.setflags(write=False)
    return s


def make_sketch(
    dim: int,
    seed: int = 0,
    *,
    rows: int | None = None,
    like: Array | None = None,
    xp: Namespace | None = None,
    device: Device | None = None,
) -> QJLSketch:
    """A seeded ``rows × dim`` Gaussian sketch (``rows`` defaults to ``dim``) in ``like``'s namespace."""
    dim = check_int("dim", dim, low=1)
    rows = dim if rows is None else check_int("rows", rows, low=1)
    seed = check_int("seed", seed, low=0)
    if like is not None:
        xp = _compat.namespace(like)
        device = _compat.device(like)
    elif xp is None:
        raise TypeError("make_sketch needs like= (an array) or xp= (an array namespace)")
    return QJLSketch(matrix=_compat.from_host(xp, _host_sketch(rows, dim, seed), device=device), seed=seed)


def qjl_encode(r: Array, sketch: QJLSketch) -> QJLCode:
    """1-bit sketch of vectors ``r`` (..., dim): packed ``sign(S r)`` and float16 ``‖r‖``.

    Notes
    -----
    QJL (Zandieh, Daliri, Han 2024, "QJL: 1-Bit Quantized JL Transform for KV Cache
    Quantization with Zero Overhead"). For a Gaussian row ``s``, ``E[⟨s, q⟩ sign⟨s, r⟩] =
    √(2/π) ⟨q, r⟩ / ‖r‖``, so the estimator of :func:`qjl_inner` is unbiased; its variance is
    at most ``(π/2) ‖q‖² ‖r‖² / m``.
    """
    xp = _compat.namespace(r)
    if not is_floating(xp, r.dtype):
        raise TypeError(f"r must have a floating dtype, received {r.dtype}")
    if r.ndim < 1 or int(r.shape[-1]) != sketch.dim:
        raise ValueError(f"r must have {sketch.dim} values on its last axis, received shape {tuple(r.shape)}")
    rf = xp.astype(r, xp.float32)
    proj = xp.matmul(rf, xp.matrix_transpose(sketch.matrix))
    bits = xp.astype(proj >= 0.0, xp.uint8)
    norms = xp.astype(xp.linalg.vector_norm(rf, axis=-1), half_dtype(xp))
    return QJLCode(signs=pack_bits(bits, 1), norms=norms, rows=sketch.rows)


def _pm1(code: QJLCode) -> Array:
    xp = _compat.namespace(code.signs)
    b = xp.astype(unpack_bits(code.signs, 1, code.rows), xp.float32)
    return 2.0 * b - 1.0


def qjl_decode(code: QJLCode, sketch: QJLSketch) -> Array:
    """Unbiased reconstruction ``√(π/2)/m · ‖r‖ · Sᵀ sign(S r)`` (float32, (..., dim))."""
    xp = _compat.namespace(code.signs)
    s = xp.matmul(_pm1(code), sketch.matrix)
    return s * ((QJL_SCALE / code.rows) * xp.astype(code.norms, xp.float32))[..., None]


def qjl_inner(q: Array, code: QJLCode, sketch: QJLSketch) -> Array:
    """Estimate ``⟨q, r⟩`` for matching leading shapes: ``q`` (..., dim), code of (...)."""
    xp = _compat.namespace(q)
    sq = xp.matmul(xp.astype(q, xp.float32), xp.matrix_transpose(sketch.matrix))
    return xp.sum(sq * _pm1(code), axis=-1) * (QJL_SCALE / code.rows) * xp.astype(code.norms, xp.float32)


def prod_encode(x: Array, codebook: Codebook, rotation: Rotation, sketch: QJLSketch) -> ProdCode:
    """TurboQuant-prod: ``codebook.bits`` bits of MSE codes plus a 1-bit QJL sketch of the residual.

    Parameters
    ----------
    x : array of float, shape (..., dim)
    codebook : Codebook
        The ``b − 1``-bit codebook for a ``b``-bit TurboQuant-prod.
    rotation : Rotation
    sketch : QJLSketch

    Returns
    -------
    ProdCode

    Notes
    -----
    Zandieh et al. 2025, Algorithm 2: ``x̂ = x̂_mse + √(π/2)/m · ‖r‖ · Sᵀ sign(S r)`` with
    ``r = x − x̂_mse`` is unbiased for inner products, ``E⟨q, x̂⟩ = ⟨q, x⟩``, with variance
    about ``(π/2) · mse_{b−1} · ‖q‖² ‖x‖² / d``.
    """
    mse = polar_encode(x, codebook, rotation)
    xp = _compat.namespace(x)
    resid = xp.astype(x, xp.float32) - polar_decode(mse, codebook, rotation)
    return ProdCode(mse=mse, qjl=qjl_encode(resid, sketch))


def prod_decode(code: ProdCode, codebook: Codebook, rotation: Rotation, sketch: QJLSketch) -> Array:
    """Unbiased reconstruction of :func:`prod_encode` (float32)."""
    return polar_decode(code.mse, codebook, rotation) + qjl_decode(code.qjl, sketch)
