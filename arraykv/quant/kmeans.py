"""Batched k-means over groups of sub-vectors: the geometry and Lloyd steps of product quantization.

A group is one (head, sub-space) pair of :mod:`arraykv.quant.vq`; every function works on all
groups at once, ``(groups, n, sub_dim)`` points against ``(groups, K, sub_dim)`` centroids, in
array-API code (the references the CPU kernels ``ops.vq_assign`` / ``ops.vq_update`` are tested
against). Distance and one-hot blocks are processed in chunks of at most ``2**24`` float32
elements.
"""

from __future__ import annotations

from .. import _compat
from .._types import Array

__all__ = ["split_subspaces", "gather_rows", "kmeans_pp", "assign_reference", "update_reference"]

# One-hot / distance blocks are processed in chunks of at most this many float32 elements.
_CHUNK_ELEMENTS = 1 << 24


def split_subspaces(x32: Array, sub_dim: int) -> Array:
    """(heads, n, d) → (heads * subspaces, n, sub_dim)."""
    xp = _compat.namespace(x32)
    h, n, d = (int(s) for s in x32.shape)
    m = d // sub_dim
    g = xp.permute_dims(xp.reshape(x32, (h, n, m, sub_dim)), (0, 2, 1, 3))
    return xp.reshape(g, (h * m, n, sub_dim))


def _sqdist(xg: Array, c: Array) -> Array:
    """Squared distances (G, n, K) between points (G, n, s) and centroids (G, K, s), clamped at 0."""
    xp = _compat.namespace(xg)
    xx = xp.sum(xg * xg, axis=-1)[:, :, None]
    cc = xp.sum(c * c, axis=-1)[:, None, :]
    d = xx - 2.0 * xp.matmul(xg, xp.matrix_transpose(c)) + cc
    return xp.where(d > 0.0, d, 0.0)


def gather_rows(c: Array, idx: Array) -> Array:
    """``c[g, idx[g, i], :]`` for c (G, K, s) and idx (G, n): (G, n, s)."""
    xp = _compat.namespace(c)
    s = int(c.shape[-1])
    full = xp.broadcast_to(idx[:, :, None], (int(idx.shape[0]), int(idx.shape[1]), s))
    return xp.take_along_axis(c, full, axis=1)


def _row_chunks(groups: int, n: int, k: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(n * k, 1))
    return [(a, min(a + step, groups)) for a in range(0, groups, step)]


def kmeans_pp(xg: Array, k: int, seed: int) -> Array:
    """k-means++ seeding (Arthur & Vassilvitskii 2007), batched over groups: centroids (G, k, s)."""
    xp = _compat.namespace(xg)
    dev = _compat.device(xg)
    groups, n, s = (int(v) for v in xg.shape)
    u = _compat.host_uniform(xp, (k, groups), seed=seed, device=dev)
    first = xp.astype(xp.floor(u[0, ...] * float(n)), xp.int64)
    first = xp.clip(first, 0, n - 1)
    chosen = [gather_rows(xg, first[:, None])]  # each (G, 1, s)
    dmin = xp.sum((xg - chosen[0]) ** 2, axis=-1)  # (G, n)
    for j in range(1, k):
        cs = xp.cumulative_sum(dmin, axis=1)
        target = u[j, ...] * cs[:, -1]
        idx = xp.sum(xp.astype(cs <= target[:, None], xp.int64), axis=1)
        idx = xp.clip(idx, 0, n - 1)
        cj = gather_rows(xg, idx[:, None])
        chosen.append(cj)
        dmin = xp.minimum(dmin, xp.sum((xg - cj) ** 2, axis=-1))
    return xp.concat(chosen, axis=1)


def assign_reference(xg: Array, c: Array) -> tuple[Array, Array]:
    """Lloyd's assignment step: nearest centroid of every point (distances by a batched matmul).

    Parameters
    ----------
    xg : array of float32, shape (groups, n, sub_dim)
    c : array of float32, shape (groups, K, sub_dim)

    Returns
    -------
    idx : array of int64, shape (groups, n)
    err : float
        The squared error of that assignment, summed.
    """
    xp = _compat.namespace(xg)
    groups, n, _ = (int(v) for v in xg.shape)
    k = int(c.shape[1])
    parts, err = [], 0.0
    for a, b in _row_chunks(groups, n, k):
        idx = xp.argmin(_sqdist(xg[a:b, ...], c[a:b, ...]), axis=-1)
        diff = xg[a:b, ...] - gather_rows(c[a:b, ...], idx)
        err += float(xp.sum(diff * diff))
        parts.append(idx)
    return (parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)), err


def update_reference(xg: Array, c: Array, idx: Array) -> Array:
    """Lloyd's update step: each centroid moves to the mean of its points (cluster sums by a one-hot matmul).

    Parameters
    ----------
    xg : array of float32, shape (groups, n, sub_dim)
    c : array of float32, shape (groups, K, sub_dim)
        Kept for empty clusters.
    idx : array of int64, shape (groups, n)

    Returns
    -------
    array of float32, shape (groups, K, sub_dim)
    """
    xp = _compat.namespace(xg)
    dev = _compat.device(xg)
    groups, n, _ = (int(v) for v in xg.shape)
    k = int(c.shape[1])
    ar = xp.arange(k, dtype=idx.dtype, device=dev)
    out = []
    for a, b in _row_chunks(groups, n, k):
        onehot = xp.astype(idx[a:b, :, None] == ar, xp.float32)  # (g, n, k)
        sums = xp.matmul(xp.matrix_transpose(onehot), xg[a:b, ...])  # (g, k, s)
        counts = xp.sum(onehot, axis=1)[:, :, None]
        out.append(xp.where(counts > 0.0, sums / xp.where(counts > 0.0, counts, 1.0), c[a:b, ...]))
    return out[0] if len(out) == 1 else xp.concat(out, axis=0)
