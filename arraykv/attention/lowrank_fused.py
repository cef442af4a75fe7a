"""Decode attention straight from a low-rank cache layer, in coefficient space.

A ``lowrank`` layer (:class:`~arraykv.caches.lowrank.LowRankCache`) holds each encoded key
and value as coefficients on a per-head basis, ``k ≈ μ_K + B_K c``, ``v ≈ μ_V + B_V e``, plus a
few float16 tokens (attention sinks and the recent window). For one new query per head,
:func:`lowrank_decode_attention` computes ``softmax(scale · q Kᵀ) V`` over all of them without
reconstructing K or V: the query is projected on the key basis once, scores are taken against
the ``r``-dimensional coefficients, and the value sum is formed in coefficient space and
lifted back once. Everything is array-API matrix products, so the same code runs on NumPy and
CuPy. It is the reference of the op :func:`arraykv.ops.lowrank_decode_attention`, whose NumPy
kernel (:mod:`arraykv.ops.numba.lowrank_fused`) reads float16 coefficients in place instead of
converting the whole layer to float32 at every step.
"""

from __future__ import annotations

from .. import _compat
from .._types import Array, Namespace
from .._validation import check_softmax_scale
from ..quant.lowrank import LowRankLayerCoefficients

__all__ = ["lowrank_decode_attention", "check_decode_args"]


def _f32(xp: Namespace, x: Array) -> Array:
    return x if x.dtype == xp.float32 else xp.astype(x, xp.float32)


def _shape(x: Array) -> tuple:
    return tuple(int(s) for s in x.shape)


def _lead(x: Array) -> tuple | None:
    """``(batch, heads, last)`` of a 4-D array's shape, None for anything else (a plain tuple: cheap to compare)."""
    if x is None or x.ndim != 4:
        return None
    s = x.shape
    return s[0], s[1], s[3]


def check_decode_args(
    q: Array,
    k_coef: Array,
    k_basis: Array,
    k_mean: Array,
    v_coef: Array,
    v_basis: Array,
    v_mean: Array,
    k_extra: Array,
    v_extra: Array,
) -> tuple:
    """Shape checks of :func:`lowrank_decode_attention` (shared with its kernels).

    Returns
    -------
    tuple of int
        ``(b, h, g, d, T, E, r_k, r_v)``: batch, KV heads, query heads per KV head, head_dim,
        encoded and kept tokens, ranks (the coefficients' last axes; 0 when ``T = 0``).

    Raises
    ------
    ValueError
        An array whose shape does not fit the others (the message names it), or no token at all.
    """
    if q.ndim != 4 or k_extra.ndim != 4:
        raise ValueError(f"q and k_extra must have 4 dimensions, received shapes {_shape(q)} and {_shape(k_extra)}")
    b, hq, one, d = q.shape
    h = k_extra.shape[1]
    if one != 1 or h < 1 or hq % h:
        raise ValueError(f"q must have shape (batch, a multiple of kv_heads={h}, 1, head_dim), received {_shape(q)}")
    for name, x in (("k_extra", k_extra), ("v_extra", v_extra)):
        if _lead(x) != (b, h, d):
            raise ValueError(
                f"{name} must have shape (batch={b}, kv_heads={h}, extra, head_dim={d}), received {_shape(x)}"
            )
    n_e = k_extra.shape[2]
    if v_extra.shape[2] != n_e:
        raise ValueError(f"v_extra must hold {n_e} tokens like k_extra, received {v_extra.shape[2]}")
    for name, c in (("k_coef", k_coef), ("v_coef", v_coef)):
        lead = _lead(c)
        if lead is None or lead[:2] != (b, h):
            raise ValueError(
                f"{name} must have shape (batch={b}, kv_heads={h}, tokens, rank), received "
                f"{None if c is None else _shape(c)}"
            )
    n_t = k_coef.shape[2]
    if v_coef.shape[2] != n_t:
        raise ValueError(f"v_coef must hold {n_t} tokens like k_coef, received {v_coef.shape[2]}")
    if n_t + n_e < 1:
        raise ValueError("the layer holds no token to attend to")
    if not n_t:
        return b, h, hq // h, d, 0, n_e, 0, 0
    r_k, r_v = k_coef.shape[3], v_coef.shape[3]
    for p, r, basis, mean in (("k", r_k, k_basis, k_mean), ("v", r_v, v_basis, v_mean)):
        if basis is None or basis.ndim != 3 or basis.shape != (h, d, r):
            raise ValueError(
                f"{p}_basis must have shape (kv_heads={h}, head_dim={d}, rank={r}) for {p}_coef of "
                f"rank {r}, received {None if basis is None else _shape(basis)}"
            )
        if mean is None or mean.ndim != 2 or mean.shape != (h, d):
            raise ValueError(
                f"{p}_mean must have shape (kv_heads={h}, head_dim={d}), received "
                f"{None if mean is None else _shape(mean)}"
            )
    return b, h, hq // h, d, n_t, n_e, r_k, r_v


def lowrank_decode_attention(
    q: Array, layer_coefficients: LowRankLayerCoefficients, k_extra: Array, v_extra: Array, *, softmax_scale: float
) -> Array:
    """One decode step of attention over a low-rank layer.

    Parameters
    ----------
    q : array of float, shape (batch, q_heads, 1, head_dim)
        ``q_heads`` a multiple of the KV heads ``h``; query head ``i`` uses KV head ``i // (q_heads // h)``.
    layer_coefficients : LowRankLayerCoefficients
        The coefficients (batch, h, T, r) of the ``T`` encoded tokens (``T`` may be 0), bases
        (h, head_dim, r) and means (h, head_dim)
        (:class:`~arraykv.quant.lowrank.LowRankLayerCoefficients`).
    k_extra, v_extra : array of float, shape (batch, h, E, head_dim)
        Tokens kept as vectors (sinks and window; ``E`` may be 0). ``T + E ≥ 1``.
    softmax_scale : float

    Returns
    -------
    array, shape (batch, q_heads, 1, head_dim), in the dtype of ``q``

    Raises
    ------
    ValueError
        Shapes that do not fit each other (:func:`check_decode_args`), no token at all, or a
        softmax scale that is not a positive finite number.

    Notes
    -----
    With ``q' = scale · q`` and ``q̃ = B_Kᵀ q'`` (one ``d × r`` product per query head), the
    score of encoded token ``t`` is ``q'·(μ_K + B_K c_t) = q'·μ_K + q̃·c_t`` and of a kept token
    ``q'·k_t``. With ``p = exp(s − max s)`` over all ``T + E`` tokens, the value sum of the
    encoded tokens is ``Σ_t p_t (μ_V + B_V e_t) = (Σ_t p_t) μ_V + B_V (Eᵀ p)``; the kept tokens
    add ``Σ p_t v_t``, and the output is the total over ``Σ p``. Per step and query head this
    costs ``O(T (r_k + r_v) + d (r_k + r_v))`` instead of the ``O(T d (r_k + r_v))`` of
    reconstructing the layer first, and it is the same attention up to float32 rounding.
    """
    softmax_scale = check_softmax_scale(softmax_scale)
    xp = _compat.namespace(q)
    lc = layer_coefficients
    k_coef, k_basis, k_mean = lc.k_coef, lc.k_basis, lc.k_mean
    v_coef, v_basis, v_mean = lc.v_coef, lc.v_basis, lc.v_mean
    b, h, g, d, n_t, n_e, _, _ = check_decode_args(
        q, k_coef, k_basis, k_mean, v_coef, v_basis, v_mean, k_extra, v_extra
    )
    hq = h * g
    qs = xp.reshape(_f32(xp, q), (b, h, g, d)) * float(softmax_scale)
    parts = []
    if n_t:
        kc = _f32(xp, k_coef)
        qt = xp.matmul(qs, k_basis)  # (b, h, g, r_k)
        bias = xp.sum(qs * k_mean[None, :, None, :], axis=-1)  # (b, h, g)
        parts.append(xp.matmul(qt, xp.matrix_transpose(kc)) + bias[..., None])  # (b, h, g, T)
    if n_e:
        parts.append(xp.matmul(qs, xp.matrix_transpose(_f32(xp, k_extra))))  # (b, h, g, E)
    s = parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)
    p = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    total = xp.sum(p, axis=-1, keepdims=True)  # (b, h, g, 1)
    out = xp.zeros((b, h, g, d), dtype=xp.float32, device=_compat.device(q))
    if n_t:
        pt = p[..., :n_t]
        w = xp.matmul(pt, _f32(xp, v_coef))  # (b, h, g, r_v)
        out = out + xp.matmul(w, xp.matrix_transpose(v_basis))
        out = out + xp.sum(pt, axis=-1, keepdims=True) * v_mean[None, :, None, :]
    if n_e:
        out = out + xp.matmul(p[..., n_t:], _f32(xp, v_extra))
    out = xp.reshape(out / total, (b, hq, 1, d))
    return out if out.dtype == q.dtype else xp.astype(out, q.dtype)
