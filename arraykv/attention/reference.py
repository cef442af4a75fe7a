"""Reference scaled-dot-product attention in the array API, with GQA and a logit bias."""

from __future__ import annotations

from .. import _compat
from .._types import Array, Namespace
from .._validation import check_softmax_scale, dtype_name, is_floating

__all__ = ["attention"]


def attention(
    q: Array, k: Array, v: Array, *, softmax_scale: float, logit_bias: Array | None = None, causal: bool = True
) -> Array:
    """Scaled dot-product attention with grouped-query heads.

    Parameters
    ----------
    q : array, shape (batch, q_heads, tokens, head_dim)
        Queries: the last ``tokens`` positions of the sequence.
    k : array, shape (batch, kv_heads, total, head_dim)
        Keys of every position the queries may attend to.
    v : array, shape (batch, kv_heads, total, v_head_dim)
        Values of those positions. ``q_heads`` must be a multiple of ``kv_heads``; query head ``h`` uses KV head
        ``h // (q_heads // kv_heads)``.
    softmax_scale : float
        Multiplies the logits ``q · k`` before the softmax.
    logit_bias : array, shape (batch, q_heads, tokens, total), optional
        Added to the scaled logits before the softmax.
    causal : bool, default True
        Mask so that query ``i`` (absolute position ``total - tokens + i``) sees keys at
        positions ``<= total - tokens + i``: the mask is aligned to the end of the keys.

    Returns
    -------
    array, shape (batch, q_heads, tokens, v_head_dim)
        In the dtype of ``q``. float16 inputs are computed in float32.

    Notes
    -----
    ``softmax(scale · q kᵀ + bias) v`` with the maximum subtracted before the exponential.
    Keys are multiplied as ``k @ qᵀ`` and the weights as ``p @ v``: on NumPy both map to
    batched BLAS calls on the stored layout without copying the cache (see
    ``docs/benchmarks.md`` for the forms that were measured).
    """
    softmax_scale = check_softmax_scale(softmax_scale)
    xp = _compat.namespace(q, k, v)
    _check_shapes(xp, q, k, v, logit_bias)
    b, hq, t, d = (int(s) for s in q.shape)
    hkv, s = int(k.shape[1]), int(k.shape[2])
    dv = int(v.shape[3])
    g = hq // hkv
    out_dtype = q.dtype
    work = xp.float32 if q.dtype == getattr(xp, "float16", None) or k.dtype == getattr(xp, "float16", None) else None
    if work is None:
        work = xp.float64 if xp.float64 in (q.dtype, k.dtype, v.dtype) else xp.float32
    qg = xp.reshape(xp.astype(q, work, copy=False), (b, hkv, g * t, d))
    kk = xp.astype(k, work, copy=False)
    vv = xp.astype(v, work, copy=False)
    # (b, hkv, s, g*t) -> (b, hkv, g*t, s)
    scores = xp.matrix_transpose(xp.matmul(kk, xp.matrix_transpose(qg)))
    scores = scores * softmax_scale
    if logit_bias is not None:
        scores = scores + xp.reshape(xp.astype(logit_bias, work, copy=False), (b, hkv, g * t, s))
    if causal and t > 1:
        dev = _compat.device(q)
        qpos = xp.arange(s - t, s, device=dev)
        kpos = xp.arange(s, device=dev)
        mask = kpos[None, :] <= qpos[:, None]  # (t, s)
        scores = xp.reshape(scores, (b, hkv, g, t, s))
        scores = xp.where(mask, scores, xp.asarray(-float("inf"), dtype=work, device=dev))
        scores = xp.reshape(scores, (b, hkv, g * t, s))
    m = xp.max(scores, axis=-1, keepdims=True)
    e = xp.exp(scores - m)
    p = e / xp.sum(e, axis=-1, keepdims=True)
    out = xp.matmul(p, vv)  # (b, hkv, g*t, dv)
    return xp.astype(xp.reshape(out, (b, hq, t, dv)), out_dtype, copy=False)


def _check_shapes(xp: Namespace, q: Array, k: Array, v: Array, logit_bias: Array | None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, tokens, head_dim), received shape {tuple(x.shape)}"
            )
        if not is_floating(xp, x.dtype):
            raise TypeError(f"{name} must have a floating dtype, received {dtype_name(x.dtype)}")
    b, hq, t, d = (int(s) for s in q.shape)
    kb, hkv, s, kd = (int(x) for x in k.shape)
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must match k in (batch, kv_heads, total), received {tuple(v.shape)} and {tuple(k.shape)}")
    if kb != b:
        raise ValueError(f"k must have batch {b} like q, received {kb}")
    if kd != d:
        raise ValueError(f"k must have head_dim {d} like q, received {kd}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q heads must be a multiple of the kv heads, received {hq} and {hkv}")
    if s < t:
        raise ValueError(f"k must hold at least the {t} query tokens, received {s}")
    if logit_bias is not None and tuple(logit_bias.shape) != (b, hq, t, s):
        raise ValueError(f"logit_bias must have shape {(b, hq, t, s)}, received {tuple(logit_bias.shape)}")
