"""Hold a Hugging Face transformers model's KV cache in an arraykv cache.

:class:`ArraykvCache` is a ``transformers.Cache`` whose layers store the keys and values that the
model's attention hands to ``cache.update`` in one arraykv cache (any method of
:func:`arraykv.available_methods`), and give back the K/V the cache reconstructs, so the model
attends over what the cache actually kept::

    from arraykv.integrations.transformers import ArraykvCache
    cache = ArraykvCache("pqo4", config=model.config)
    out = model.generate(input_ids, cache=cache, max_new_tokens=32)   # past_key_values= before 5.x

Written against the layered cache API of transformers 5 (``Cache`` holding one
``CacheLayerMixin`` per layer; tested with transformers 5.24.0 and torch 2.13 on CPU). Each
layer's ``update(key_states, value_states)`` receives torch tensors ``(batch, kv_heads,
new_tokens, head_dim)``, shares their memory with NumPy (``Tensor.numpy()``, no copy for float32
CPU tensors), stores them with ``cache.prefill`` and returns the reconstructed K/V of every token
held, ``(batch, kv_heads, total, head_dim)``, as torch tensors of the input dtype (sharing the
NumPy result's memory when that dtype is float32).

Notes
-----
Queries. ``update`` is called before attention and is given no queries. The ``pq``/``pqo``
caches weight key channels by query statistics (``key_scale``), so given the model
(``ArraykvCache(method, config=model.config, model=model)``) the cache hooks each attention
module: a forward hook keeps the output of its ``q_proj`` (and ``q_norm`` where the module has
one), a pre-hook its ``position_embeddings``, and ``update`` turns them into the layer's
queries with the module's own ``apply_rotary_pos_emb``: the queries the model's attention
uses, so ``"pqo4"`` is then the quantizer of the NumPy decoder's ``pqo4``. Without the model
(or for attention modules without ``q_proj``/``position_embeddings``) the cache gets a zero
``q`` of shape ``(batch, kv_heads, new_tokens, head_dim)``, every key channel weight is 1, and
``"pqo4"`` is the quantizer :class:`~arraykv.integrations.decoder.model.DecoderModel` runs with
``key_scale=False`` (see docs/transformers.md for the measured difference).
:attr:`ArraykvCache.hooked_layers` says how many layers hand their queries over.

Attention. By default the model computes attention itself over the K/V ``update`` returns, so
a ``logit_bias`` (the ``tq`` QJL correction) cannot be used and ``tq`` methods are refused.
With ``fused=True`` (the default with ``model=``) one-token decode steps attend from the
cache instead: :mod:`arraykv.integrations.transformers.attention`.

The model is borrowed, not changed. The hooks and the switched attention implementation last
as long as the cache: :meth:`ArraykvCache.detach` removes them, and so does the cache's
garbage collection (a finalizer that does not keep the cache alive); the last fused cache on a
model to go puts back the exact implementation each of its configs had. While a cache is
attached, every call it does not own (no cache, a ``DynamicCache``, another ArraykvCache) runs
the model's own attention function with the model's own mask, so its logits are the model's to
the last bit. Several caches may be attached to one model: each serves the calls it is passed
to (``cache=``/``past_key_values=``).

Batch rows. Beam search (``reorder_cache``), ``num_return_sequences`` and contrastive search
(``batch_repeat_interleave``, ``batch_select_indices``) move whole rows of every layer:
:meth:`ArraykvCache.select_rows` (:mod:`arraykv.caches.batch_rows`).

Memory. The compressed cache is what persists between steps. During a step the model attends
over float K/V, so the reconstructed past of the layer being computed exists as float32 (plus
the model's own copies, e.g. ``repeat_kv`` for grouped-query attention), and is freed when the
layer is done. With ``incremental=True`` the reconstructed past of *every* layer is kept between
steps as well (only the tokens whose reconstruction changed are decoded each step, which is
faster): that holds more memory than transformers' ``DynamicCache``, not less.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from ...protocol import BATCH_ROWS, INCREMENTAL, TRANSACTIONS, TRUNCATION, KVTransaction, supports
from ..common.optional import require

try:
    import torch as _torch
except ImportError as _exc:
    raise ImportError(
        "torch is needed for ArraykvCache and is not installed by arraykv: install the torch build "
        "you want (e.g. the CPU wheel from https://pytorch.org), then "
        'python -m pip install "arraykv[hf]"'
    ) from _exc
_transformers = require("transformers", "hf")

from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402 - after the install hint

from ..common.generation import held_rewrites  # noqa: E402 - after the install hint
from ..common.torch_tensors import float32_numpy, to_torch  # noqa: E402 - after the install hint

__all__ = ["ArraykvCache", "ArraykvLayer"]

#: Why a layer of an ArraykvCache does not move its batch rows by itself.
_WHOLE_CACHE = (
    "an ArraykvCache moves the batch rows of all its layers in one step: call {0} on the cache, not on one layer"
)

#: The arraykv cache methods whose output the model cannot use (a logit bias needs our attention).
_LOGIT_BIAS_PREFIXES = ("tq",)


def _geometry(config: Any) -> tuple[int, int, int, tuple[str, ...], int | None]:
    """``(num_layers, num_kv_heads, head_dim, layer_types, sliding_window)`` of a transformers
    decoder config, checked (``sliding_window`` None when no layer slides)."""
    if config is None:
        raise TypeError("config is required: pass the model's config (model.config)")
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError:
            config = get_text()
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("ArraykvCache supports decoder-only models; this config is an encoder-decoder one")
    name = type(config).__name__
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"config ({name}) must have a positive int num_hidden_layers, it has {layers!r}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"config ({name}) must have a positive int num_attention_heads, it has {heads!r}")
    kv = getattr(config, "num_key_value_heads", None)
    kv = heads if kv is None else kv
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ValueError(f"config ({name}) num_key_value_heads must divide num_attention_heads={heads}, it is {kv!r}")
    hd = getattr(config, "head_dim", None)
    if hd is None:
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int) or hidden % heads:
            raise ValueError(
                f"config ({name}) has no head_dim and hidden_size={hidden!r} is not a multiple of "
                f"num_attention_heads={heads}"
            )
        hd = hidden // heads
    if not isinstance(hd, int) or hd < 1:
        raise ValueError(f"config ({name}) head_dim must be a positive int, it is {hd!r}")
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        from ...caches.hybrid import check_layer_types

        try:
            types = check_layer_types(types, layers)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config ({name}): {exc}") from None
    elif window is not None and getattr(config, "use_sliding_window", True):
        types = ("sliding_attention",) * layers  # a window on every layer (Mistral-style)
    else:
        types = ("full_attention",) * layers
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"config ({name}) has sliding-window layers but sliding_window={window!r}")
    return layers, kv, hd, types, (window if "sliding_attention" in types else None)


class ArraykvLayer(CacheLayerMixin):
    """One model layer's view of an :class:`ArraykvCache` (what ``Cache.layers`` holds).

    Stores nothing itself: every call goes to layer ``index`` of the owner's arraykv cache.
    ``keys`` and ``values`` stay None (the K/V live compressed in the arraykv cache).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: ArraykvCache, index: int, window: int | None = None):
        super().__init__()
        self._owner = owner
        self.index = index
        self.device = None
        self.dtype = None
        #: The attention span of a sliding-window layer (None: the layer attends to everything).
        self.sliding_window = window
        self.is_sliding = window is not None

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple:
        """Store ``new_tokens`` K/V; return the K/V of every token of this layer.

        Parameters
        ----------
        key_states, value_states : torch.Tensor, shape (batch, kv_heads, new_tokens, head_dim)
            float32, float16 or bfloat16 on the CPU.

        Returns
        -------
        tuple of torch.Tensor
            Keys and values, shape ``(batch, kv_heads, total, head_dim)``, dtype of the input.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple:
        """``(kv_length, kv_offset)`` for the attention mask: every stored token plus the new ones;
        for a sliding layer, the last ``window - 1`` stored tokens plus the new ones."""
        n = self.get_seq_length()
        if self.sliding_window is None:
            return n + int(query_length), 0
        w = self.sliding_window
        return min(n, w - 1) + int(query_length), max(n - w + 1, 0)

    def get_seq_length(self) -> int:
        """Tokens stored in this layer."""
        return int(self._owner.arraykv_cache.seq_len(self.index))

    def get_max_length(self) -> int:
        """The window of a sliding layer, else the cache's ``max_tokens``, or -1 (no maximum)."""
        if self.sliding_window is not None:
            return int(self.sliding_window)
        m = getattr(self._owner.arraykv_cache, "max_tokens", None)
        return -1 if m is None else int(m)

    def reset(self) -> None:
        self._owner._reset_layer(self.index)
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        self._owner._crop(self.index, tokens_to_remove)

    def reorder_cache(self, beam_idx: Any) -> None:
        """Refused: the rows of every layer move together, :meth:`ArraykvCache.reorder_cache`."""
        raise NotImplementedError(_WHOLE_CACHE.format("reorder_cache"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: the rows of every layer move together, :meth:`ArraykvCache.batch_repeat_interleave`."""
        raise NotImplementedError(_WHOLE_CACHE.format("batch_repeat_interleave"))

    def batch_select_indices(self, indices: Any) -> None:
        """Refused: the rows of every layer move together, :meth:`ArraykvCache.batch_select_indices`."""
        raise NotImplementedError(_WHOLE_CACHE.format("batch_select_indices"))

    def offload(self) -> None:  # nothing held in torch memory to move
        return None

    def prefetch(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"ArraykvLayer({self.index}, tokens={self.get_seq_length()})"


class ArraykvCache(Cache):
    """A transformers ``Cache`` that keeps K/V in an arraykv cache.

    Parameters
    ----------
    method : str
        An arraykv cache method (``"dense"``, ``"pqo4"``, ``"int4"``, ...; see
        :func:`arraykv.available_methods`). ``tq`` methods are refused: their QJL logit bias
        cannot enter the model's attention.
    config : transformers.PretrainedConfig
        The model's config (``model.config``): ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: the attention heads), ``head_dim`` (default
        ``hidden_size // num_attention_heads``), ``layer_types`` and ``sliding_window``: global
        layers hold every token in ``method``, sliding-window layers (Gemma 2/3, Mistral-style)
        their last ``sliding_window`` tokens (a :class:`~arraykv.HybridCache`); chunked- and
        linear-attention layers are refused.
    incremental : bool, default False
        False: each step reconstructs the layer's whole past from the compressed state and
        nothing but the compressed state is kept between steps. True: keep every layer's
        reconstructed past between steps and decode only the tokens whose reconstruction
        changed (faster; holds a float32 copy of the whole past, more than ``DynamicCache``).
    model : transformers.PreTrainedModel, optional
        The model the cache serves: its attention modules are hooked so that each update gets
        the layer's queries (see the module notes). The hooks stay until :meth:`detach` or
        until the cache is garbage collected, whichever comes first.
    fused : bool, optional
        Needs ``model``: switch the model's attention modules to the fused attention function
        (:mod:`~arraykv.integrations.transformers.attention`, registered as
        ``"arraykv_fused_<implementation>"``), so that one-token decode steps are attended from
        the cache (its fused kernels) instead of over a rebuilt float past; a step whose
        attention mask hides a stored token (padding) is attended over the rebuilt past
        instead. Calls the cache does not own go to the model's own attention unchanged.
        :meth:`detach` or the cache's collection switches it back. Default: on when ``model``
        is given (and ``incremental`` is not).
    **cache_options
        Passed to :func:`arraykv.make_cache` (e.g. ``bits``, ``window``, ``max_tokens``).

    Attributes
    ----------
    arraykv_cache : CompressedKVCache
        The arraykv cache holding the tokens (``memory_usage()``, ``save`` ...).
    method : str
    num_layers, num_kv_heads, head_dim : int
    hooked_layers : int
        Layers whose queries reach the cache (0 without ``model``).

    Examples
    --------
    >>> cache = ArraykvCache("pqo4", config=model.config)                  # doctest: +SKIP
    >>> out = model.generate(ids, cache=cache, max_new_tokens=20)          # doctest: +SKIP
    >>> cache.arraykv_cache.memory_usage()                                 # doctest: +SKIP

    Notes
    -----
    Tensors must be on the CPU (arraykv's NumPy caches); float16 and bfloat16 K/V are stored
    as float32 and returned in the input dtype. Beam search (``reorder_cache``), batch
    expansion after prefill (``batch_repeat_interleave``) and ``batch_select_indices`` move
    the rows of every layer at once (:meth:`select_rows`); ``crop`` (assisted decoding) works
    as far as the arraykv cache can truncate exactly.

    Two caches on one model: each is attached by its own hooks, and the fused attention serves
    a call from the cache whose ``update`` returned the key tensor it is given, i.e. the cache
    passed to that call; both can be used alternately, each giving what it gives alone (tested).
    The model's attention implementation comes back when the last of them is detached or
    collected. Without ``model=`` a cache changes nothing on the model. Not compileable (``torch.compile``
    of the model with this cache is not supported). See the module notes for what the missing
    queries mean for the ``pqo`` methods and what is held in memory.
    """

    def __init__(
        self,
        method: str,
        *,
        config: Any,
        incremental: bool = False,
        model: Any = None,
        fused: bool | None = None,
        **cache_options: Any,
    ):
        from ...caches import make_cache

        if not isinstance(method, str):
            raise TypeError(f"method must be a string (an arraykv cache method), received {type(method).__name__}")
        if method.startswith(_LOGIT_BIAS_PREFIXES):
            raise ValueError(
                f"method {method!r} corrects attention logits with a logit_bias, which the model's "
                "own attention cannot apply; use a pq/pqo/int/dense method"
            )
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be a bool, received {type(incremental).__name__}")
        self.num_layers, self.num_kv_heads, self.head_dim, self.layer_types, window = _geometry(config)
        geometry = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if window is None:
            self.arraykv_cache = make_cache(method, **geometry, **cache_options)
        else:  # sliding layers hold their window (default_window_storage of the method), global ones the method
            window_options = dict(cache_options.pop("window_options", None) or {})
            if "rollback_tokens" in cache_options:
                window_options.setdefault("rollback_tokens", cache_options["rollback_tokens"])
            self.arraykv_cache = make_cache(
                "hybrid",
                **geometry,
                layer_types=self.layer_types,
                window=window,
                full_method=method,
                full_options=cache_options,
                window_options=window_options,
            )
        full = getattr(self.arraykv_cache, "full", None)
        if getattr(self.arraykv_cache, "qjl", False) or getattr(full, "qjl", False):
            raise ValueError(
                f"method {method!r} with qjl=True corrects attention logits with a logit_bias, which the "
                "model's own attention cannot apply; use qjl=False (or a pq/pqo/int/dense method)"
            )
        self.method = method
        self.incremental = incremental
        # layer -> (k, v, tokens, stable): the float32 past returned last (incremental mode only)
        #: Per layer, in incremental mode: (k, v, tokens, stable length, the cache's rewrites) of the last read.
        self._held: dict[int, tuple[np.ndarray, np.ndarray, int, int, int | None]] = {}
        # the transaction of the forward under way, begun at layer 0's update (see update)
        self._step_txn: KVTransaction | None = None
        self.hooked_layers = 0
        super().__init__(
            layers=[
                ArraykvLayer(self, i, window if kind == "sliding_attention" else None)
                for i, kind in enumerate(self.layer_types)
            ]
        )
        # layer -> the attention module's captured q projection and (cos, sin) of its current call
        self._q_parts: dict[int, dict[str, Any]] = {}
        # layer -> the new token's (k, v) and the key tensor update returned, held for the fused
        # attention of this step (which claims it by that tensor)
        self._pending: dict[int, tuple[np.ndarray, np.ndarray, Any]] = {}
        self.fused = False
        if fused is None:  # the fast path wherever it is correct: with the model's attention modules
            fused = model is not None and not incremental
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool or None, received {type(fused).__name__}")
        if fused and model is None:
            raise ValueError("fused=True needs the model (model=...): its attention is switched to the cache's")
        if model is not None:
            import weakref

            from .attention import attach

            attachment = attach(self, model, fused=fused)
            # hooks off and the model's attention back when this cache is collected (or detach()ed)
            self._release = weakref.finalize(self, attachment.release)
            self._release.atexit = False
            self.hooked_layers = attachment.hooked_layers
            self.fused = attachment.fused

    # -- fused decode attention (arraykv.integrations.transformers.attention) ----------------
    def _claim(self, i: int, key: Any) -> tuple[np.ndarray, np.ndarray, Any] | None:
        """The token held for layer ``i`` if this call's ``key`` is the tensor ``update`` returned
        for it (the call is this cache's), taken; else None."""
        pending = self._pending.get(i)
        if pending is None or pending[2] is not key:
            return None
        del self._pending[i]
        return pending

    def _fused_step(
        self,
        module: Any,
        pending: tuple[np.ndarray, np.ndarray, Any],
        query: Any,
        attention_mask: Any,
        own: Callable[..., tuple[Any, ...]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...]:
        """Store the held token with the arraykv cache's ``decode`` and return the attention output.

        ``own`` is the model's own attention function, called with the model's ``args`` and
        ``kwargs`` where the cache answers with K/V, or where the fused kernels cannot do what
        the call asks: a mask that hides a stored token (padding), a logit soft-cap, dropout.
        """
        from ...protocol import AttendConfig, Fused

        k, v, _ = pending
        i = module.layer_idx
        q = float32_numpy(query)
        cache = self.arraykv_cache
        if _hides_a_token(attention_mask) or kwargs.get("softcap") is not None or kwargs.get("dropout"):
            before = cache.seq_len(i)
            r = cache.prefill(i, k, v, q)
            if self.incremental:
                self._held.pop(i, None)
            if attention_mask is not None:
                keep = int(attention_mask.shape[-1])  # the keys the mask covers (a sliding layer: its window)
            elif self.layer_types[i] == "sliding_attention":
                keep = min(before, self._window(i) - 1) + 1
            else:
                keep = int(r.k.shape[2])
            kk, vv = to_torch(r.k[:, :, -keep:], query.dtype), to_torch(r.v[:, :, -keep:], query.dtype)
            return own(module, query, kk, vv, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        scale = float(scaling) if scaling is not None else self.head_dim**-0.5
        decoded = cache.decode(i, k, v, q, AttendConfig(scale, int(q.shape[1]) // self.num_kv_heads))
        if self.incremental:
            self._held.pop(i, None)
        if isinstance(decoded, Fused):
            out = _torch.from_numpy(np.ascontiguousarray(decoded.output)).to(query.dtype)  # (b, heads, 1, d)
            return out.transpose(1, 2).contiguous(), None
        kk, vv = to_torch(decoded.result.k, query.dtype), to_torch(decoded.result.v, query.dtype)
        return own(module, query, kk, vv, attention_mask, *args, **kwargs)

    def detach(self) -> None:
        """Remove the hooks that hand this cache the model's queries (later updates get zeros), and
        give the model its own attention back if ``fused`` switched it.

        The same happens when the cache is garbage collected. Another cache attached to the same
        model keeps its own hooks; the model's attention implementation comes back when the last
        fused cache on it is detached or collected. Calling it again does nothing.
        """
        release = getattr(self, "_release", None)
        if release is not None:
            release()
        self._q_parts.clear()
        self._pending.clear()
        self.hooked_layers = 0
        self.fused = False

    def _queries(self, i: int, k: Any) -> Any:
        """Layer ``i``'s queries of this update as float32 NumPy (b, heads, t, d); zeros like ``k``
        without hooks (and for sliding layers, whose window cache reads no queries).

        Raises
        ------
        RuntimeError
            The model is hooked but this update's queries could not be rebuilt (an attention
            layout the hooks do not know): better refused than quantized with zero queries.
        """

        from .attention import layer_queries

        part = self._q_parts.pop(i, None)
        if self.hooked_layers == 0 or self.layer_types[i] == "sliding_attention":
            return np.zeros(k.shape, dtype=np.float32)
        q = layer_queries(part, k, self.num_kv_heads)
        if q is None:
            raise RuntimeError(
                f"layer {i}: the hooked attention module did not hand over the queries of this update "
                f"({int(k.shape[2])} tokens); its layout is not one ArraykvCache knows. Build the cache "
                "without model= (key channels then get weights of 1) or call cache.detach()"
            )
        return q

    def _window(self, i: int) -> int:
        """The window of layer ``i``, a sliding one (its ``ArraykvLayer.sliding_window``)."""
        window = cast(ArraykvLayer, self.layers[i]).sliding_window  # the layers are those __init__ made
        if window is None:
            raise ValueError(f"layer {i} is not a sliding-window layer")
        return window

    # -- the work of one update ----------------------------------------------------------
    def _update(self, i: int, key_states: Any, value_states: Any) -> tuple:
        torch = _torch
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, received {type(t).__name__}")
            if t.device.type != "cpu":
                raise NotImplementedError(
                    f"{name} is on {t.device}; ArraykvCache holds NumPy caches and accepts CPU tensors only"
                )
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, received {t.dtype}")
        dtype = key_states.dtype
        k, v = float32_numpy(key_states), float32_numpy(value_states)

        self._pending.pop(i, None)  # a token held by a call that never reached attention: gone
        part = self._q_parts.get(i)
        if self.fused and k.shape[2] == 1 and self.arraykv_cache.seq_len(i) > 0 and part and "pos" in part:
            # one new token per sequence, in a call of the hooked model: the attention function
            # claims it by the key tensor returned here, stores it and attends (fused)
            self._q_parts.pop(i, None)
            self._pending[i] = (k.copy(), v.copy(), key_states)
            return key_states, value_states

        q = self._queries(i, k)  # the hooked model's queries, or zeros (see module notes)
        cache = self.arraykv_cache
        prev = self._held.get(i) if self.incremental else None
        if prev is not None and (prev[2] != cache.seq_len(i) or prev[4] != held_rewrites(cache)):
            prev = None  # the layer changed behind our back (reset, crop, truncated and refilled): read it back whole
        if self.layer_types[i] == "sliding_attention":  # what transformers' mask covers: the last window - 1
            before = cache.seq_len(i)
            r = cache.prefill(i, k, v, q)
            keep = min(before, self._window(i) - 1) + int(k.shape[2])
            return to_torch(r.k[:, :, -keep:], dtype), to_torch(r.v[:, :, -keep:], dtype)
        if prev is None or not supports(cache, INCREMENTAL):
            r = cache.prefill(i, k, v, q)
            kk, vv = r.k, r.v
            if self.incremental:
                self._held[i] = (kk.copy(), vv.copy(), int(cache.seq_len(i)), 0, held_rewrites(cache))
        else:  # cache: narrowed to IncrementalKVCache (seq_len read through self.arraykv_cache)
            k_prev, v_prev, _, stable, _ = prev
            cache.append(i, k, v, q)
            tail = cache.dequantize(i, stable)
            if tail is None:  # None only for a layer holding nothing, which append just filled
                raise RuntimeError(f"layer {i}: the cache holds no tokens after append")
            kk = np.concatenate([k_prev[:, :, :stable], tail.k], axis=2)
            vv = np.concatenate([v_prev[:, :, :stable], tail.v], axis=2)
            self._held[i] = (
                kk,
                vv,
                int(self.arraykv_cache.seq_len(i)),
                int(cache.stable_length(i)),
                held_rewrites(cache),
            )
        return to_torch(kk, dtype), to_torch(vv, dtype)

    def _reset_layer(self, i: int) -> None:
        self._held.pop(i, None)
        if self.arraykv_cache.seq_len(i):
            if supports(self.arraykv_cache, TRUNCATION):
                self.arraykv_cache.truncate(i, 0)
            else:
                self.arraykv_cache.reset()

    def _crop(self, i: int, tokens_to_remove: int) -> None:
        if not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove (transformers' convention), "
                f"received {tokens_to_remove!r}"
            )
        n = self.arraykv_cache.seq_len(i)
        if tokens_to_remove == 0 or n == 0:
            return
        target = max(0, n + tokens_to_remove)
        if not supports(self.arraykv_cache, TRUNCATION):
            raise NotImplementedError(f"the {self.method!r} cache cannot drop tokens (no truncate)")
        if not self.arraykv_cache.can_truncate(i, target):
            raise NotImplementedError(
                f"the {self.method!r} cache of layer {i} cannot go back exactly from {n} to {target} tokens "
                f"(it can reach {self.arraykv_cache.min_truncate_length(i)} and up); nothing was removed"
            )
        self.arraykv_cache.truncate(i, target)
        self._held.pop(i, None)

    # -- the Cache interface ---------------------------------------------------------------
    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple:
        """Store the new K/V of layer ``layer_idx`` (transformers' ``Cache.update``), checked.

        With the model given (every layer hooked), a forward's updates form one transaction of
        the arraykv cache, begun at layer 0's update: a forward that fails part way is taken
        back whole at the next call (:meth:`_take_back_a_torn_step`)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(
                f"the model updates layer {layer_idx!r}, but this ArraykvCache was built for "
                f"{self.num_layers} layers; build it from the model's own config (model.config)"
            )
        if layer_idx == 0:
            self._take_back_a_torn_step()
            if self.hooked_layers == self.num_layers and supports(self.arraykv_cache, TRANSACTIONS):
                self._step_txn = self.arraykv_cache.begin_transaction()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens stored (transformers reads it before a forward to place the new tokens)."""
        if layer_idx == 0:
            self._take_back_a_torn_step()
        return super().get_seq_length(layer_idx)

    def _take_back_a_torn_step(self) -> None:
        """Settle the last forward before anything reads or extends the cache.

        A forward that failed part way (at layer ``i``, after layers ``0 .. i-1`` stored its
        tokens; any exception, ``KeyboardInterrupt``, ``MemoryError``) leaves the layers at
        different lengths: its transaction (begun at layer 0's update) is rolled back, which
        puts every layer back exactly as it was before that forward, at any length. A forward
        whose every layer stored its tokens is committed. Only for a cache given its model
        (every layer hooked): the model's forward updates every layer, so layers at different
        lengths mean a failed one; a caller updating single layers by hand is left alone.
        """
        txn, self._step_txn = self._step_txn, None
        if txn is not None and not txn.open:
            txn = None  # ended by hand
        if self.hooked_layers != self.num_layers:
            if txn is not None:
                txn.commit()  # detached since: nothing to judge by
            return  # without the model, updates of single layers are legitimate: nothing to judge by
        cache = self.arraykv_cache
        lengths = [int(cache.seq_len(i)) for i in range(self.num_layers)]
        torn = min(lengths) != max(lengths)
        if not torn:
            if txn is not None:
                txn.commit()
            return
        if txn is not None:
            txn.rollback()
        self._held.clear()
        self._pending.clear()
        self._q_parts.clear()
        if txn is not None:
            return
        # a cache without transactions: truncate the partial step away where it can
        why = None
        if supports(cache, TRUNCATION):
            try:
                cache.truncate_all(min(lengths))
            except ValueError as exc:
                why = str(exc)
        else:
            why = "it has no truncate_all"
        if why is not None:
            raise RuntimeError(
                f"a failed forward left layers at lengths {sorted(set(lengths))} and the "
                f"{self.method!r} cache cannot take the partial step back exactly ({why}); "
                "call cache.reset()"
            )

    # -- batch rows: beam search, num_return_sequences, contrastive search ---------------------
    def select_rows(self, indices: Any) -> None:
        """Keep the batch rows ``indices`` of every layer, in that order (reorder, repeat, select).

        Row ``i`` of every layer becomes row ``indices[i]`` of before
        (:meth:`arraykv.caches.LayeredCache.select_rows`: codes, norms, calibration, windows,
        rollback copies; state shared by all rows kept); atomic. Nothing happens to an empty cache.

        Parameters
        ----------
        indices : sequence of int or 1-D integer tensor/array
            Row numbers, each ``0 <= i < batch``; repeats allowed.

        Raises
        ------
        TypeError, ValueError
            Not 1-D integers, empty, or a row outside the batch; nothing changes.
        """
        from ...caches.batch_rows import check_rows

        rows = check_rows(indices)
        self._take_back_a_torn_step()
        cache = self.arraykv_cache
        if not any(cache.seq_len(i) for i in range(self.num_layers)):
            return
        if not supports(cache, BATCH_ROWS):
            raise NotImplementedError(f"the {self.method!r} cache cannot move batch rows (no select_rows)")
        cache.select_rows(rows)
        self._pending.clear()
        self._q_parts.clear()
        try:  # the float pasts of incremental mode follow their rows
            now = held_rewrites(cache)  # select_rows counts as a rewrite; these reads follow it
            self._held = {i: (h[0][rows], h[1][rows], h[2], h[3], now) for i, h in self._held.items()}
        except BaseException:
            self._held = {}  # they are only a shortcut: read back whole next time
            raise

    def reorder_cache(self, beam_idx: Any) -> None:
        """Beam search: row ``i`` of every layer becomes row ``beam_idx[i]`` of before (:meth:`select_rows`).

        Parameters
        ----------
        beam_idx : torch.LongTensor, shape (batch,)
            The row each beam continues.
        """
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (rows ``0, 0, 1, 1, ...``), as transformers' layers do.

        Parameters
        ----------
        repeats : int
            At least 1.
        """
        from ..._validation import check_int

        repeats = check_int("repeats", repeats, low=1)
        if not supports(self.arraykv_cache, BATCH_ROWS):
            raise NotImplementedError(f"the {self.method!r} cache cannot move batch rows (no batch_size)")
        batch = self.arraykv_cache.batch_size()
        if batch and repeats > 1:
            self.select_rows([r for r in range(batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: Any) -> None:
        """Keep only the rows ``indices`` (:meth:`select_rows`).

        Parameters
        ----------
        indices : torch.LongTensor or sequence of int, shape (rows,)
            The rows kept, in order.
        """
        self.select_rows(indices)

    def reset(self) -> None:
        """Forget every token of every layer."""
        self.arraykv_cache.reset()
        self._held.clear()
        for layer in self.layers:
            cast(ArraykvLayer, layer).is_initialized = False  # the layers are those __init__ made

    @property
    def is_compileable(self) -> bool:
        return False

    def memory_usage(self) -> int:
        """Bytes held: the arraykv cache's ``memory_usage()`` plus the float pasts kept when ``incremental``."""
        held = sum(h[0].nbytes + h[1].nbytes for h in self._held.values())
        return int(self.arraykv_cache.memory_usage()) + held

    def __repr__(self) -> str:
        return (
            f"ArraykvCache({self.method!r}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, tokens={self.get_seq_length()})"
        )


def _hides_a_token(mask: Any) -> bool:
    """Whether an attention mask (None, bool or additive float) hides any key from any query."""
    if mask is None:
        return False
    if mask.dtype == _torch.bool:
        return not bool(mask.all())
    return bool((mask < 0).any())
