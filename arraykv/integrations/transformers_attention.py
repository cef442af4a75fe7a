"""The hooks of an ArraykvCache in a transformers model: the layers' queries, and decode attention from the cache.

Queries (:func:`hook_queries`, :func:`layer_queries`): a forward hook on each attention
module's ``q_proj`` (``q_norm`` where there is one) keeps its output and a pre-hook its
``position_embeddings``; the cache's ``update`` turns them into the layer's queries with the
module's own ``apply_rotary_pos_emb``.

Fused decode (:func:`fused_attention`):

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

__all__ = ["FUSED_NAME", "register_fused_attention", "fused_attention", "hook_queries", "layer_queries"]

#: The attention-implementation name the fused function is registered under.
FUSED_NAME = "arraykv_fused"


def register_fused_attention(base: str = "sdpa") -> None:
    """Register :func:`fused_attention` with transformers' ``AttentionInterface`` (idempotent).

    Its masks are built as for ``base``, the implementation it hands every other call to (a
    padded batch needs the mask in that implementation's form).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(FUSED_NAME, fused_attention)
    mask_of = ALL_MASK_ATTENTION_FUNCTIONS.get(base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa")
    AttentionMaskInterface.register(FUSED_NAME, mask_of)


def _base(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager", FUSED_NAME):
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def fused_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None, **kwargs: Any
) -> tuple:
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


def hook_queries(cache: Any, model: Any) -> tuple:
    """Hook every attention module of ``model`` whose queries ``cache`` can rebuild.

    Parameters
    ----------
    cache : ArraykvCache
        Receives each call's parts in ``cache._q_parts[layer]`` (held through a weak reference).
    model : torch.nn.Module
        Attention modules are those with an int ``layer_idx`` below ``cache.num_layers``, a
        ``q_proj`` and an ``apply_rotary_pos_emb`` in their module.

    Returns
    -------
    tuple
        ``(hook handles, number of layers hooked)``.
    """
    import sys
    import weakref

    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        cfg = get_text(decoder=True)
    n = getattr(cfg, "num_hidden_layers", None)
    if isinstance(n, int) and n != cache.num_layers:
        raise ValueError(
            f"the model has {n} layers but the cache was built for {cache.num_layers}; "
            "build it from the model's own config (model.config)"
        )
    me = weakref.ref(cache)
    hooks, found = [], 0
    for module in model.modules():
        i = getattr(module, "layer_idx", None)
        q_proj = getattr(module, "q_proj", None)
        if not isinstance(i, int) or not 0 <= i < cache.num_layers or q_proj is None:
            continue
        rope = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
        if rope is None:
            continue
        q_norm = getattr(module, "q_norm", None)
        q_src = q_proj if q_norm is None else q_norm
        head_dim = int(getattr(module, "head_dim", cache.head_dim))

        def keep_q(mod, args, out, i=i, head_dim=head_dim, rope=rope):
            owner = me()
            if owner is not None:
                owner._q_parts.setdefault(i, {}).update(
                    q=out, head_dim=head_dim, rope=rope, heads_first=_heads_first(args[0] if args else out)
                )

        def keep_pos(mod, args, kwargs, i=i):
            owner = me()
            pos = kwargs.get("position_embeddings")
            if pos is None and len(args) > 1:
                pos = args[1]
            if owner is not None:
                owner._q_parts.setdefault(i, {})["pos"] = pos
                mod._arraykv_owner = me  # fused_attention finds its cache here

        hooks.append(q_src.register_forward_hook(keep_q))
        hooks.append(module.register_forward_pre_hook(keep_pos, with_kwargs=True))
        found += 1
    return hooks, min(found, cache.num_layers)


def layer_queries(part: Any, k: Any, num_kv_heads: int) -> Any:
    """One layer's queries from its hooked parts: float32 NumPy ``(b, heads, t, d)``, or None.

    None where the hooks saw no call, or a call not of this update's tokens (the caller decides
    whether that is an error). The queries may come from the projection ``(b, t, heads * d)``,
    or from a QK-norm applied before ``(b, t, heads, d)`` or after ``(b, heads, t, d)`` the head
    transpose (told apart by the norm input's strides, :func:`_heads_first`).
    """
    from .torch_tensors import float32_numpy

    if not part or part.get("q") is None or part.get("pos") is None:
        return None
    q, (cos, sin) = part["q"], part["pos"]
    b, t = int(k.shape[0]), int(k.shape[2])
    d = part["head_dim"]
    q = q.detach()
    if q.ndim == 4 and part.get("heads_first"):  # QK-norm after the head transpose: (b, heads, t, d)
        if q.shape[0] != b or q.shape[2] != t or q.shape[3] != d:
            return None
    else:  # (b, t, heads * d) from the projection, or (b, t, heads, d) from a norm before the transpose
        if q.shape[0] != b or q.shape[1] != t or q.numel() % (b * t * d):
            return None
        q = q.reshape(b, t, -1, d).transpose(1, 2)
    q, _ = part["rope"](q, q, cos, sin)
    q = float32_numpy(q.contiguous())
    return q if q.shape[1] % num_kv_heads == 0 else None


def _heads_first(x: Any) -> bool:
    """Whether a 4-d query tensor is laid out ``(b, heads, t, d)`` (transposed after the projection).

    A norm applied after the head transpose sees the projection's ``(b, t, heads, d)`` view with
    axes 1 and 2 swapped, so its axis 1 steps by ``d`` and axis 2 by ``heads * d``; before the
    transpose the strides are the other way round. Equal strides (one head, or one token) leave
    the two layouts the same up to a size-1 axis.
    """
    if getattr(x, "ndim", 0) != 4:
        return False
    s1, s2 = x.stride(1), x.stride(2)
    if s1 != s2:
        return s1 < s2
    return int(x.shape[2]) != 1 and int(x.shape[1]) == 1
