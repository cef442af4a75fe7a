"""Seeded random rotations: randomized Walsh–Hadamard or a random orthogonal matrix.

Convention
----------
For a power-of-two ``dim`` the rotation is ``y = H (s ⊙ x) / sqrt(dim)``: random signs ``s``
first, then the unnormalized Walsh–Hadamard matrix ``H`` (Sylvester order, ``H[i, j] =
(-1)^popcount(i & j)``) over the whole vector, then ``1/sqrt(dim)``. Its inverse is
``x = s ⊙ (H y) / sqrt(dim)`` because ``H Hᵀ = dim · I`` and ``H`` is symmetric. For other
sizes the rotation is a Haar-random orthogonal matrix ``Q`` and ``y = Q x``.

Both are generated on the host with NumPy's seeded ``default_rng(seed)`` and moved to the
caller's namespace, so the same seed gives the same rotation on NumPy and on CuPy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .. import _compat
from .._types import Array, Device, Namespace
from .._validation import check_int

__all__ = ["Rotation", "make_rotation", "rotate", "unrotate", "fwht", "is_power_of_two"]


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Rotation:
    """A seeded orthogonal transform of ``dim``-vectors.

    Attributes
    ----------
    kind : str
        ``"hadamard"`` (randomized Walsh–Hadamard, power-of-two ``dim``) or ``"orthogonal"``.
    dim : int
        Vector length.
    seed : int
        Seed of NumPy's ``default_rng`` that produced ``signs`` / ``matrix``.
    signs : array of float32, shape (dim,)
        The random ±1 signs ``s`` (all ones for ``"orthogonal"``).
    matrix : array of float32, shape (dim, dim), or None
        The dense rotation ``M`` with ``y = M x`` for ``"orthogonal"``; None for
        ``"hadamard"``, which is applied as a fast transform (``O(d log d)``, nothing but the
        signs held). :meth:`dense` builds ``M`` for either kind.
    """

    kind: str
    dim: int
    seed: int
    signs: Array
    matrix: Array

    @property
    def nbytes(self) -> int:
        """Bytes held by ``signs`` and ``matrix``."""
        n = _compat.array_nbytes(self.signs)
        return n if self.matrix is None else n + _compat.array_nbytes(self.matrix)

    def dense(self) -> Array:
        """``M`` as a (dim, dim) float32 array in the namespace of ``signs``."""
        if self.matrix is not None:
            return self.matrix
        xp = _compat.namespace(self.signs)
        eye = xp.eye(self.dim, dtype=xp.float32, device=_compat.device(self.signs))
        return xp.matrix_transpose(rotate(eye, self))

    @property
    def bits_per_value(self) -> float:
        """A rotation stores no per-value data: 0."""
        return 0.0


@functools.lru_cache(maxsize=64)
def _host_rotation(dim: int, seed: int) -> tuple[str, Array, Array | None]:
    """Generate ``(kind, signs, matrix)`` as NumPy float32 arrays on the host (seeded)."""
    np = _compat.host_numpy()  # host-side computation of a fixed table

    rng = np.random.default_rng(seed)
    if is_power_of_two(dim):
        signs = rng.choice(np.array([-1.0, 1.0]), size=dim)
        idx = np.arange(dim)
        # H[i, j] = (-1)^popcount(i & j)
        pc = np.zeros((dim, dim), dtype=np.int64)
        a = idx[:, None] & idx[None, :]
        while a.any():
            pc += a & 1
            a = a >> 1
        h = np.where(pc % 2 == 0, 1.0, -1.0)
        matrix = h * signs[None, :] / math.sqrt(dim)
        kind = "hadamard"
    else:
        g = rng.standard_normal((dim, dim))
        qm, r = np.linalg.qr(g)
        qm = qm * np.sign(np.diag(r))[None, :]  # Haar measure
        signs = np.ones(dim)
        matrix = qm
        kind = "orthogonal"
    signs = np.ascontiguousarray(signs, dtype=np.float32)
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    signs.setflags(write=False)
    matrix.setflags(write=False)
    return kind, signs, matrix


def make_rotation(
    dim: int, seed: int = 0, *, like: Array | None = None, xp: Namespace | None = None, device: Device | None = None
) -> Rotation:
    """A seeded random rotation of ``dim``-vectors in the namespace of ``like`` (or ``xp``).

    Parameters
    ----------
    dim : int
        Vector length, >= 2. Powers of two get the randomized Walsh–Hadamard transform,
        other sizes a Haar-random orthogonal matrix.
    seed : int, default 0
        Seed of NumPy's ``default_rng``; the same seed gives the same rotation everywhere.
    like : array, optional
        Take the namespace and device from this array.
    xp, device : optional
        Namespace and device when ``like`` is not given (one of the two is required).

    Returns
    -------
    Rotation

    Notes
    -----
    A random rotation makes every coordinate of a unit vector follow the density
    ``f(x) ∝ (1 − x²)^((d−3)/2)`` whatever the input (TurboQuant, Zandieh et al. 2025;
    PolarQuant). The signs must be applied *before* the Hadamard transform: applied after it,
    they only flip output signs and a constant or one-hot vector stays concentrated.
    """
    dim = check_int("dim", dim, low=2)
    seed = check_int("seed", seed, low=0)
    kind, signs, matrix = _host_rotation(dim, seed)
    if like is not None:
        xp = _compat.namespace(like)
        device = _compat.device(like)
    elif xp is None:
        raise TypeError("make_rotation needs like= (an array) or xp= (an array namespace)")
    return Rotation(
        kind=kind,
        dim=dim,
        seed=seed,
        signs=_compat.from_host(xp, signs, device=device),
        matrix=None if kind == "hadamard" else _compat.from_host(xp, matrix, device=device),
    )


def fwht(x: Array) -> Array:
    """Unnormalized Walsh–Hadamard transform ``H x`` along the last (power-of-two) axis.

    ``log2(d)`` butterfly stages, each ``(a, b) -> (a + b, a - b)`` on halves of blocks of
    ``2h``; Sylvester order, so ``H[i, j] = (-1)^popcount(i & j)``.
    """
    xp = _compat.namespace(x)
    lead = tuple(int(s) for s in x.shape[:-1])
    d = int(x.shape[-1])
    h = 1
    while h < d:
        x = xp.reshape(x, lead + (d // (2 * h), 2, h))
        a, b = x[..., 0, :], x[..., 1, :]
        x = xp.stack([a + b, a - b], axis=-2)
        h *= 2
    return xp.reshape(x, lead + (d,))


def rotate(x: Array, rotation: Rotation) -> Array:
    """``y = M x`` along the last axis. ``x``: (..., dim) float32 → (..., dim) float32."""
    xp = _compat.namespace(x)
    if rotation.matrix is None:
        return fwht(x * rotation.signs) * (1.0 / math.sqrt(rotation.dim))
    return xp.matmul(x, xp.matrix_transpose(rotation.matrix))


def unrotate(y: Array, rotation: Rotation) -> Array:
    """``x = Mᵀ y`` along the last axis (the inverse of :func:`rotate`)."""
    xp = _compat.namespace(y)
    if rotation.matrix is None:
        return fwht(y) * (rotation.signs * (1.0 / math.sqrt(rotation.dim)))
    return xp.matmul(y, rotation.matrix)
