"""The hooks of an ArraykvCache in a transformers model: the layers' queries, and decode attention from the cache.

Queries (:func:`attach`, :func:`layer_queries`): a forward hook on each attention module's
``q_proj`` (``q_norm`` where there is one) keeps its output and a pre-hook its
``position_embeddings``; the cache's ``update`` turns them into the layer's queries with the
module's own ``apply_rotary_pos_emb``.

Fused decode: a transformers model calls ``cache.update(k, v)`` and then its attention
function over the K/V that ``update`` returned, so an
:class:`~arraykv.integrations.transformers.cache.ArraykvCache` normally rebuilds every layer's float
past each step. With ``fused=True`` the configs of the hooked attention modules are switched to
an attention function of this module, registered under :func:`fused_name` of the
implementation they had (``"arraykv_fused_sdpa"`` for ``"sdpa"``), with that implementation's
mask function. On a one-token decode step ``update`` only holds the new token's K/V; the
attention function stores it with the arraykv cache's ``decode`` and answers with the cache's
attention output (:class:`~arraykv.Fused`: computed from the packed codes by the fused kernels,
no float past rebuilt), or, for a cache that answers with :class:`~arraykv.Dequantized`, with
the model's own attention over those K/V.

Which cache a call belongs to: the one whose ``update`` returned the very key tensor the
attention function is given (the models of transformers pass it straight on; a model that
changes the keys in between is refused with a ``RuntimeError`` rather than attended over the
new token alone). Every other call
(the prompt, several new tokens, a call with another cache or none) goes to the model's own
attention function, called with exactly its arguments, so its output is the model's own to
the last bit. Several caches may be attached to one model at once: each serves the calls it
is passed to.

Lifetime (:class:`Attachment`): the hooks, the switched configs and the caches' places in the
module registry are held by an attachment that the cache releases on ``detach()`` and, through
:func:`weakref.finalize`, when it is garbage collected. The last attachment released on a
config puts its exact former ``_attn_implementation_internal`` back (unless someone changed
it meanwhile), so a model without live caches is the model it was.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

__all__ = [
    "FUSED_NAME",
    "Attachment",
    "attach",
    "fused_name",
    "register_fused_attention",
    "fused_attention",
    "layer_queries",
]

#: The prefix of the attention-implementation names the fused functions are registered under.
FUSED_NAME = "arraykv_fused"

#: What the model's attention function is: ``(attn_output, attention weights or None)`` back.
AttentionFunction = Callable[..., tuple[Any, ...]]


class _FusedOwner(Protocol):
    """What the hooks and the fused function use of an ``ArraykvCache`` (which imports this module)."""

    num_layers: int
    head_dim: int
    #: layer -> the hooked parts of its current call (``q``, ``pos``, ``head_dim``, ``rope``, ``heads_first``)
    _q_parts: dict[int, dict[str, Any]]
    #: layer -> the token ``update`` holds for the fused attention, and the key tensor it returned
    _pending: dict[int, tuple[Any, Any, Any]]

    def _claim(self, i: int, key: Any) -> tuple[Any, Any, Any] | None: ...

    def _fused_step(
        self,
        module: Any,
        pending: tuple[Any, Any, Any],
        query: Any,
        attention_mask: Any,
        own: AttentionFunction,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...]: ...


#: One attached cache in :data:`_SERVING`: its attachment's token and a weak reference to it.
_Serving = tuple[object, weakref.ref[_FusedOwner]]

#: Guards the registries below (re-entrant: a garbage collection may release an attachment
#: while this thread holds it).
_LOCK = threading.RLock()
#: Attention module -> ((token, weak reference to the cache), ...) of the attached caches whose
#: fused decode may serve it; replaced, never mutated, so readers need no lock.
_SERVING: weakref.WeakKeyDictionary[Any, tuple[_Serving, ...]] = weakref.WeakKeyDictionary()
#: id(config) -> its switch (configs are not hashable).
_SWITCHED: dict[int, _Switch] = {}
#: fused name -> the implementation it serves for.
_BASES: dict[str, str | None] = {}


def fused_name(base: str | None) -> str:
    """The name the fused function for implementation ``base`` is registered under.

    ``FUSED_NAME + "_" + base`` (``"arraykv_fused_sdpa"``): the base's name stays inside it, so
    checks of transformers that read the name (``"flash" in ...``) answer as for the base.
    """
    return f"{FUSED_NAME}_{'unset' if base is None else base}"


def register_fused_attention(base: str | None = "sdpa") -> str:
    """Register the fused attention function for implementation ``base`` (idempotent); its name.

    The function hands every call no cache owns to ``base``'s attention function (as the model
    looks it up: ``ALL_ATTENTION_FUNCTIONS.get_interface(base, <its module's eager attention>)``)
    and its masks are built by ``base``'s mask function, or not at all where ``base`` has none,
    as for ``base`` itself.

    Parameters
    ----------
    base : str or None
        The attention implementation the model had (``"sdpa"``, ``"eager"``, ...).

    Returns
    -------
    str
        :func:`fused_name` of ``base``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = fused_name(base)
    with _LOCK:
        if _BASES.get(name, 0) == base:
            return name
        AttentionInterface.register(name, _fused_for(base))
        masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        if base in masks:
            # cast: mypy joins the mapping's differently typed mask functions into ``function``
            AttentionMaskInterface.register(name, cast("Callable[..., Any]", masks[base]))
        _BASES[name] = base
    return name


def _own_attention(base: str | None, module: Any) -> AttentionFunction:
    """The attention function the model calls for ``module`` under implementation ``base``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager: AttentionFunction | None = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        eager = eager_attention_forward
    if base is None:  # what get_interface(None, eager) answers, without its warning
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(base, eager)


#: base -> its fused function (one per implementation, so that registering again is a no-op).
_FUNCTIONS: dict[str | None, AttentionFunction] = {}


def _fused_for(base: str | None) -> AttentionFunction:
    made = _FUNCTIONS.get(base)
    if made is not None:
        return made

    def fused(
        module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> tuple[Any, ...]:
        own = _own_attention(base, module)
        serving = [c for c in (ref() for _, ref in _SERVING.get(module, ())) if c is not None]
        for cache in serving:
            pending = cache._claim(module.layer_idx, key)
            if pending is not None:
                return cache._fused_step(module, pending, query, attention_mask, own, args, kwargs)
        if any(module.layer_idx in cache._pending for cache in serving):
            # held by this very call's update (the pre-hook dropped older ones), yet not the key
            # tensor update returned: attending over the new token alone would be silently wrong
            raise RuntimeError(
                f"layer {module.layer_idx}: the attention function was given other keys than the "
                "ArraykvCache's update returned (the model changes them in between); build the cache "
                "with fused=False"
            )
        return own(module, query, key, value, attention_mask, *args, **kwargs)

    fused.__name__ = fused.__qualname__ = f"fused_attention_{base}"
    fused.__doc__ = fused_attention.__doc__
    return _FUNCTIONS.setdefault(base, fused)


def fused_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any
) -> tuple[Any, ...]:
    """The attention of ``module`` for transformers: the arraykv cache's fused decode where a cache owns the call.

    The function registered for ``"sdpa"`` (the one for another implementation,
    :func:`register_fused_attention`, differs only in the function it hands other calls to).

    Parameters
    ----------
    module : torch.nn.Module
        An attention module of the model.
    query : torch.Tensor, shape (batch, heads, new_tokens, head_dim)
    key, value : torch.Tensor, shape (batch, kv_heads, kv_tokens, head_dim)
        What the cache's ``update`` returned (the new token alone on a fused step).
    attention_mask : torch.Tensor or None
    *args, **kwargs
        The model's other arguments (``scaling``, ``dropout``, ...), passed on unchanged.

    Returns
    -------
    tuple
        ``(attn_output (batch, new_tokens, heads, head_dim), attention weights or None)``, as
        transformers' attention functions return.
    """
    return _fused_for("sdpa")(module, query, key, value, attention_mask, *args, **kwargs)


class _Switch:
    """A config switched to a fused name: what to put back, and the attachments holding it."""

    def __init__(self, config: Any, original: Any, name: str):
        self.config = weakref.ref(config)
        self.original = original
        self.name = name
        self.holders: set[object] = set()


class Attachment:
    """One cache's hold on one model: hooks, switched configs, its place in the registry.

    Holds no reference to the cache (the hooks hold a weak one), so the cache can be collected;
    :meth:`release` undoes everything and may be called any number of times, from ``detach()``
    or from the finalizer of the collected cache.

    Attributes
    ----------
    hooked_layers : int
        Layers whose queries reach the cache.
    fused : bool
        Whether the model's attention modules were switched to the fused function.
    """

    def __init__(self) -> None:
        self.token = object()
        self.hooks: list[Any] = []  # torch's RemovableHandle of each hook
        self.modules: list[weakref.ref[Any]] = []  # weak references to the attention modules served
        self.configs: list[int] = []  # ids of the configs switched
        self.hooked_layers = 0
        self.fused = False

    def release(self) -> None:
        """Remove the hooks, leave the registry, and give the configs their implementation back."""
        with _LOCK:
            hooks, self.hooks = self.hooks, []
            for h in hooks:
                h.remove()
            modules, self.modules = self.modules, []
            for ref in modules:
                module = ref()
                if module is None:
                    continue
                left = tuple(e for e in _SERVING.get(module, ()) if e[0] is not self.token)
                if left:
                    _SERVING[module] = left
                else:
                    _SERVING.pop(module, None)
            configs, self.configs = self.configs, []
            for key in configs:
                switch = _SWITCHED.get(key)
                if switch is None or self.token not in switch.holders:
                    continue
                switch.holders.discard(self.token)
                if switch.holders:
                    continue
                del _SWITCHED[key]
                cfg = switch.config()
                if cfg is not None and getattr(cfg, "_attn_implementation_internal", None) == switch.name:
                    cfg._attn_implementation_internal = switch.original
            self.fused = False
            self.hooked_layers = 0


def attach(cache: _FusedOwner, model: Any, *, fused: bool) -> Attachment:
    """Hook ``model``'s attention modules for ``cache``, and switch them to the fused function if ``fused``.

    Parameters
    ----------
    cache : ArraykvCache
        Receives each call's query parts in ``cache._q_parts[layer]`` (through a weak reference).
    model : torch.nn.Module
        Attention modules are those with an int ``layer_idx`` below ``cache.num_layers``, a
        ``q_proj`` and an ``apply_rotary_pos_emb`` in their module.
    fused : bool
        Also switch the configs of those modules to :func:`fused_name` of their implementation
        (needs every layer hooked, and a ``config`` on each module).

    Returns
    -------
    Attachment
        To release on ``detach()`` and when the cache is collected.

    Raises
    ------
    ValueError
        The model has another number of layers than the cache, or ``fused`` and not every layer
        could be hooked; nothing is left attached.
    """
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
    out = Attachment()
    try:
        modules = _hook_queries(cache, model, out)
        if fused:
            if out.hooked_layers != cache.num_layers:
                raise ValueError(
                    f"fused=True needs every layer's attention module hooked; found {out.hooked_layers} "
                    f"of {cache.num_layers} (modules with layer_idx, q_proj and apply_rotary_pos_emb)"
                )
            _switch(cache, modules, out)
    except BaseException:
        out.release()
        raise
    return out


def _hook_queries(cache: _FusedOwner, model: Any, out: Attachment) -> list[Any]:
    """Hook every attention module whose queries ``cache`` can rebuild; the modules hooked."""
    me = weakref.ref(cache)
    modules = []
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

        def keep_q(mod: Any, args: Any, result: Any, i: int = i, head_dim: int = head_dim, rope: Any = rope) -> None:
            owner = me()
            if owner is not None:
                owner._q_parts.setdefault(i, {}).update(
                    q=result, head_dim=head_dim, rope=rope, heads_first=_heads_first(args[0] if args else result)
                )

        def keep_pos(mod: Any, args: Any, kwargs: Any, i: int = i) -> None:
            owner = me()
            pos = kwargs.get("position_embeddings")
            if pos is None and len(args) > 1:
                pos = args[1]
            if owner is not None:
                owner._q_parts.setdefault(i, {})["pos"] = pos
                owner._pending.pop(i, None)  # a token held by an earlier call that failed before attention

        out.hooks.append(q_src.register_forward_hook(keep_q))
        out.hooks.append(module.register_forward_pre_hook(keep_pos, with_kwargs=True))
        modules.append(module)
    out.hooked_layers = min(len(modules), cache.num_layers)
    return modules


def _switch(cache: _FusedOwner, modules: list[Any], out: Attachment) -> None:
    """Switch the configs of ``modules`` to the fused function and register ``cache`` as serving them."""
    configs = {}
    for module in modules:
        cfg = getattr(module, "config", None)
        # a transformers config (PretrainedConfig) keeps the implementation in this attribute
        if cfg is None or not hasattr(cfg, "_attn_implementation_internal"):
            raise ValueError(
                f"fused=True needs attention modules with a transformers config; {type(module).__name__} has none"
            )
        configs[id(cfg)] = cfg
    with _LOCK:
        for key, cfg in configs.items():
            current = cfg._attn_implementation_internal
            switch = _SWITCHED.get(key)
            if switch is not None and switch.config() is cfg and current == switch.name:
                switch.holders.add(out.token)  # another live cache switched it: share its switch
            else:
                base = _BASES.get(current, current) if isinstance(current, str) else current
                name = register_fused_attention(base)
                replaced = switch.holders if switch is not None and switch.config() is cfg else set()
                switch = _SWITCHED[key] = _Switch(cfg, current, name)
                switch.holders |= replaced | {out.token}
                cfg._attn_implementation_internal = name
            out.configs.append(key)
        entry = (out.token, weakref.ref(cache))
        for module in modules:
            _SERVING[module] = _SERVING.get(module, ()) + (entry,)
            out.modules.append(weakref.ref(module))
        out.fused = True


def layer_queries(part: Any, k: Any, num_kv_heads: int) -> Any:
    """One layer's queries from its hooked parts: float32 NumPy ``(b, heads, t, d)``, or None.

    None where the hooks saw no call, or a call not of this update's tokens (the caller decides
    whether that is an error). The queries may come from the projection ``(b, t, heads * d)``,
    or from a QK-norm applied before ``(b, t, heads, d)`` or after ``(b, heads, t, d)`` the head
    transpose (told apart by the norm input's strides, :func:`_heads_first`).
    """
    from ..common.torch_tensors import float32_numpy

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
    s1, s2 = int(x.stride(1)), int(x.stride(2))
    if s1 != s2:
        return s1 < s2
    return int(x.shape[2]) != 1 and int(x.shape[1]) == 1
