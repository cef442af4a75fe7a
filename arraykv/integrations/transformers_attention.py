"""Decode attention straight from an arraykv cache inside a transformers model.

A transformers model calls ``cache.update(k, v)`` and then its attention function over the K/V
that ``update`` returned, so an :class:`~arraykv.integrations.transformers.ArraykvCache`
normally rebuilds every layer's float past each step. With ``fused=True`` the cache registers
the attention function :func:`fused_attention` under the name ``"arraykv_fused"`` and switches
the model to it: on a one-token decode step of a single sequence, ``update`` only holds the new
token's K/V, and the attention function stores it with the arraykv cache's ``decode`` and
answers with the cache's attention output (:class:`~arraykv.Fused`: computed from the packed
codes by the fused kernels, no float past rebuilt), or, for a cache that answers with
:class:`~arraykv.Dequantized`, with the model's own attention over those K/V. Every other call
(the prompt, several sequences, several new tokens) goes to the attention function the model
used before.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FUSED_NAME", "register_fused_attention", "fused_attention"]

#: The attention-implementation name the fused function is registered under.
FUSED_NAME = "arraykv_fused"


def register_fused_attention() -> None:
    """Register :func:`fused_attention` with transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FUSED_NAME, fused_attention)


def _base(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager", FUSED_NAME):
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def fused_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                    **kwargs: Any) -> tuple:
    """The attention of ``module`` for transformers: the arraykv cache's fused decode where it has one.

    Parameters
    ----------
    module : torch.nn.Module
        An attention module hooked by an ``ArraykvCache(..., fused=True)``.
    query : torch.Tensor, shape (batch, heads, new_tokens, head_dim)
    key, value : torch.Tensor, shape (batch, kv_heads, kv_tokens, head_dim)
        What the cache's ``update`` returned (the new token alone on a fused step).
    attention_mask : torch.Tensor or None
    scaling : float, optional
        Softmax scale (default ``head_dim ** -0.5``).

    Returns
    -------
    tuple
        ``(attn_output (batch, new_tokens, heads, head_dim), None)``, as transformers' attention
        functions return.
    """
    owner = getattr(module, "_arraykv_owner", None)
    cache = owner() if owner is not None else None
    base = _base(getattr(cache, "_base_attention", None))
    if cache is None:
        return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    pending = cache._pending.pop(module.layer_idx, None)
    if pending is None:
        return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return cache._fused_step(module, pending, query, attention_mask, scaling, base, kwargs)
