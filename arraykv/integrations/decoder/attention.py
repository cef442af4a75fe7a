"""The attention pieces of :class:`~arraykv.integrations.decoder.model.DecoderModel`: RoPE tables and the prefill masks.

Pure functions over the arrays the model holds, so the model class keeps its weights and the
order of a layer's steps, and this module the positions and masks of one attention call:

- :func:`rope_tables` — ``cos``/``sin`` of shape ``(length, head_dim // 2)``, float32;
- :func:`apply_rope` — rotate-half RoPE of ``(batch, heads, t, head_dim)`` from a position on;
- :func:`causal_mask`, :func:`window_mask` — the additive masks of a prefill chunk.

The attention call itself (shared with the ONNX Runtime operator) is in
:mod:`arraykv.integrations.common.layer_attention`.

``xp`` is the namespace the model computes in (plain NumPy 2 on CPU, see :func:`plain_numpy`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._types import Array, Namespace
from ..common.layer_attention import causal_block

__all__ = [
    "plain_numpy",
    "rope_tables",
    "apply_rope",
    "causal_mask",
    "window_mask",
]


def plain_numpy() -> Namespace:
    """NumPy itself when it offers the array-API names (NumPy 2), else ``array_api_compat.numpy``.

    Calling NumPy directly skips a wrapper per operation (a few percent of a decode step at 135M
    parameters).
    """

    if hasattr(np, "permute_dims") and hasattr(np, "concat") and hasattr(np, "matrix_transpose"):
        return np
    import array_api_compat.numpy as xnp

    return xnp


def rope_tables(xp: Any, device: Any, length: int, head_dim: int, theta: float) -> tuple[Array, Array]:
    """``(cos, sin)`` of RoPE for positions ``0 .. length-1``.

    Returns
    -------
    cos, sin : arrays of shape (length, head_dim // 2), float32, in ``xp`` on ``device``
    """

    half = head_dim // 2
    inv = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim))
    ang = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return (
        xp.asarray(np.cos(ang).astype(np.float32), device=device),
        xp.asarray(np.sin(ang).astype(np.float32), device=device),
    )


def apply_rope(xp: Any, x: Any, cos: Any, sin: Any, start: int) -> Any:
    """Rotate ``x`` of shape (batch, heads, t, head_dim) for positions ``start .. start+t-1`` (rotate-half layout)."""
    t = int(x.shape[2])
    half = int(x.shape[3]) // 2
    c = cos[start : start + t, :]
    s = sin[start : start + t, :]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concat([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def causal_mask(xp: Any, device: Any, t: int, total: int) -> Any:
    """(t, total) float32 additive mask of the last ``t`` queries over ``total`` keys, in ``xp`` on ``device``."""

    m = np.concatenate([np.zeros((t, total - t), dtype=np.float32), causal_block(t)], axis=1)
    return xp.asarray(m, device=device)


def window_mask(xp: Any, device: Any, t: int, n: int, first_key: int, first_query: int, window: int) -> Any:
    """(t, n) float32 additive mask of a sliding window.

    Query ``i`` (position ``first_query + i``) sees key ``j`` (position ``first_key + j``) when
    ``0 <= q_pos - k_pos < window``: itself and the ``window - 1`` positions before it.
    """

    qp = first_query + np.arange(t)[:, None]
    kp = first_key + np.arange(n)[None, :]
    d = qp - kp
    m = np.where((d >= 0) & (d < window), 0.0, -np.inf).astype(np.float32)
    return xp.asarray(m, device=device)
