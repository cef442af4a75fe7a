"""Attention of one layer's new queries over its keys, shared by the own decoder and the ONNX Runtime operator.

- :func:`attend_one` — one new query over ``total`` keys (decode; no mask needed);
- :func:`attend_chunk` — ``t`` new queries, the last ``t`` of ``total`` keys, causally (prefill);
- :func:`causal_block` — the ``(t, t)`` causal block of the new keys.

``xp`` is the namespace the caller computes in (plain NumPy 2 on CPU, see
:func:`arraykv.integrations.decoder.attention.plain_numpy`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["attend_one", "attend_chunk", "causal_block"]


def _grouped(xp: Any, q: Any, k: Any, v: Any) -> tuple[tuple[int, int, int, int, int, int, int], Any, Any]:
    """Sizes ``(b, hq, t, d, hkv, total, g)`` and ``k``/``v`` cast to ``q``'s dtype."""
    b, hq, t, d = (int(s) for s in q.shape)
    hkv, total = int(k.shape[1]), int(k.shape[2])
    if k.dtype != q.dtype:
        k = xp.astype(k, q.dtype)
        v = xp.astype(v, q.dtype)
    return (b, hq, t, d, hkv, total, hq // hkv), k, v


def attend_one(xp: Any, q: Any, k: Any, v: Any, bias: Any, scale: float) -> Any:
    """Attention of one new query token over ``total`` keys (the decode case).

    The same math as :func:`arraykv.attention` for ``tokens == 1`` (no mask needed), without its
    input checks.

    Parameters
    ----------
    q : array, shape (b, H, 1, d)
    k, v : arrays, shape (b, Hkv, total, d)
    bias : array of shape (b, H, 1, total), or None
        Added to the scaled logits.
    scale : float

    Returns
    -------
    array, shape (b, H, 1, d), dtype of ``q``
    """
    (b, hq, _, d, hkv, total, g), k, v = _grouped(xp, q, k, v)
    qg = xp.reshape(q, (b, hkv, g, d))
    s = xp.matrix_transpose(xp.matmul(k, xp.matrix_transpose(qg))) * scale  # (b, hkv, g, total)
    if bias is not None:
        s = s + xp.reshape(xp.astype(bias, s.dtype), (b, hkv, g, total))
    s = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    p = s / xp.sum(s, axis=-1, keepdims=True)
    return xp.reshape(xp.matmul(p, v), (b, hq, 1, int(v.shape[3])))


def attend_chunk(
    xp: Any, q: Any, k: Any, v: Any, bias: Any, scale: float, *, in_place: bool, mask: Any = None, full_mask: Any = None
) -> Any:
    """Causal attention of ``t`` new query tokens, the last ``t`` of ``total`` keys (the prefill case).

    The same math as :func:`arraykv.attention` with ``causal=True``, in fewer passes over the
    ``(b, kv_heads, groups * t, total)`` scores: the scale is folded into ``q``, the mask
    touches only the last ``t`` key columns (earlier keys are visible to every new query), the
    normalization divides the ``(t, d)`` output instead of the weights, and with ``in_place``
    (NumPy) the softmax runs in place.

    Parameters
    ----------
    q : array, shape (b, H, t, d)
    k, v : arrays, shape (b, Hkv, total, d)
    bias : array of shape (b, H, t, total), or None
    scale : float
    in_place : bool
        ``xp`` is NumPy: mask and softmax in place on the scores.
    mask : callable, optional
        ``mask(t, total)``: the ``(t, total)`` additive mask in ``xp``'s namespace and device
        (:func:`~arraykv.integrations.decoder.attention.causal_mask`); needed when ``in_place`` is False and ``t > 1``.
    full_mask : array, optional
        A ``(t, total)`` additive mask over every key column, used instead of the causal one
        (a sliding window, :func:`~arraykv.integrations.decoder.attention.window_mask`).

    Returns
    -------
    array, shape (b, H, t, d), dtype of ``q``
    """
    (b, hq, t, d, hkv, total, g), k, v = _grouped(xp, q, k, v)
    s = xp.matmul(xp.reshape(q * scale, (b, hkv, g * t, d)), xp.matrix_transpose(k))
    if bias is not None:
        s = s + xp.reshape(xp.astype(bias, s.dtype), (b, hkv, g * t, total))
    if full_mask is not None:
        if in_place:
            s5 = np.reshape(s, (b, hkv, g, t, total))
            s5 += full_mask
        else:
            s = xp.reshape(xp.reshape(s, (b, hkv, g, t, total)) + full_mask, (b, hkv, g * t, total))
        s = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    elif in_place:  # on the fresh scores array
        if t > 1:
            np.reshape(s, (b, hkv, g, t, total))[..., total - t :] += causal_block(t)
        s -= np.max(s, axis=-1, keepdims=True)
        np.exp(s, out=s)
    else:
        if t > 1:
            s = xp.reshape(xp.reshape(s, (b, hkv, g, t, total)) + mask(t, total), (b, hkv, g * t, total))
        s = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    o = xp.matmul(s, v) / xp.sum(s, axis=-1, keepdims=True)
    return xp.reshape(o, (b, hq, t, int(v.shape[3])))


def causal_block(t: int) -> Any:
    """(t, t) float32 NumPy: 0 on and below the diagonal, -inf above (query i sees new keys <= i)."""

    return np.triu(np.full((t, t), -np.inf, dtype=np.float32), k=1)
