"""A decoder in the array API whose attention goes through a :class:`CompressedKVCache`.

The reference "framework-independent inference code": RMSNorm, rotary position embedding
(rotate-half layout), grouped-query attention, a gated feed-forward block and tied (or
separate) input/output embeddings, in float32. What differs between Llama, Qwen 2/3 and Gemma 3
(QKV biases, QK-norm, sandwich norms, the gate's activation, embedding scale, sliding-window
layers with their own RoPE base) is read from an
:class:`~arraykv.integrations.decoder.architectures.Architecture`, not written as another decoder.
Sliding-window layers attend to the last ``sliding_window`` positions; :meth:`DecoderModel.make_cache`
gives such a model a :class:`~arraykv.HybridCache` whose sliding layers hold only the window. The
prompt goes through ``cache.prefill`` (in
chunks of ``chunk_size`` tokens for long prompts, each chunk continuing the sequence) and every
further token through ``cache.decode``, which answers either with the attention output
(:class:`~arraykv.Fused`) or with keys and values (:class:`~arraykv.Dequantized`, possibly with
a ``logit_bias``) for :func:`arraykv.attention`.

Speed on NumPy comes from the weight layout, not from clever code: every matrix is stored
transposed and contiguous, ``(in_features, out_features)``, so ``x @ W`` is one BLAS call; Q, K
and V are one fused matrix, gate and up are one fused matrix; the RoPE tables are computed once.
Prefill attention runs its softmax in place over ``(chunk, total)`` scores, and the output head
can be limited to the last position (``logits="last"``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ... import _compat
from ...protocol import AttendConfig, Fused
from ..common.generation import GenerationFront, cache_length as _cache_len, check_chunk, undo_on_failure
from ..common.layer_attention import attend_chunk, attend_one
from ..common.prompt_stage import PromptStage, serving_cache, stages_layer
from .architectures import architecture
from .attention import apply_rope, causal_mask, plain_numpy, rope_tables, window_mask
from .model_config import ModelConfig
from .weights import LayerWeights, layout_gguf_tensors, random_gguf_tensors, unpermute_qk

__all__ = ["DecoderModel", "LayerWeights", "random_gguf_tensors", "unpermute_qk"]


class DecoderModel(GenerationFront):
    """A decoder (Llama, Qwen 2/3, Gemma 3) over NumPy or CuPy arrays.

    Build one with :func:`arraykv.integrations.decoder.gguf_loading.load_model` (or
    :meth:`from_gguf_tensors`). Text generation is
    :meth:`~arraykv.integrations.common.generation.GenerationFront.generate`, the one every
    engine shares.

    Parameters
    ----------
    config : ModelConfig
    layers : list of LayerWeights
    embedding : array, shape (vocab, hidden), float32
    output_norm : array, shape (hidden,)
    lm_head : array or None, shape (vocab, hidden)
        None for tied embeddings (the output projection reuses ``embedding``).
    tokenizer : GGUFTokenizer, optional

    Attributes
    ----------
    config, tokenizer, xp
        ``xp`` is the array namespace of the weights.
    """

    def __init__(
        self,
        config: ModelConfig,
        layers: list[LayerWeights],
        embedding: Any,
        output_norm: Any,
        lm_head: Any = None,
        tokenizer: Any = None,
    ):
        self.config = config
        self.arch = architecture(config.arch)
        self.layers = layers
        self.embedding = embedding
        self.output_norm = output_norm
        self.lm_head = lm_head
        self.tokenizer = tokenizer
        self.xp = _compat.namespace(embedding)
        # NumPy 2 offers the array-API names itself; calling it directly skips a wrapper per
        # operation (a few percent of a decode step at 135M parameters).
        self._numpy = _compat.is_numpy(self.xp)
        self._ops = plain_numpy() if self._numpy else self.xp
        self._dev = _compat.device(embedding)
        self._scale = 1.0 / math.sqrt(config.head_dim)
        self._attend = AttendConfig(softmax_scale=self._scale, n_kv_groups=config.n_kv_groups)
        self._kinds = config.kinds
        # float32(sqrt(hidden)), the factor Gemma multiplies its embeddings by
        self._embed_scale = float(np.float32(math.sqrt(config.hidden_size))) if self.arch.embed_scale else 1.0
        self._rope_len = 0
        self._cos: Any = None
        self._sin: Any = None
        self._rope: dict[str, tuple[Any, Any]] = {}
        self._ensure_rope(min(config.context_length, 4096))

    # -- construction --------------------------------------------------------------
    @classmethod
    def from_gguf_tensors(
        cls, config: ModelConfig, tensors: dict[str, Any], *, tokenizer: Any = None, xp: Any = None
    ) -> DecoderModel:
        """Lay out dequantized GGUF tensors for fast decoding.

        Parameters
        ----------
        config : ModelConfig
        tensors : dict of str to numpy.ndarray
            GGUF tensor names (``blk.{i}.attn_q.weight`` ...) to float32 ``(out, in)`` arrays.
        tokenizer : GGUFTokenizer, optional
        xp : array namespace, optional
            Where the weights live (``array_api_compat.cupy`` for a GPU); NumPy by default.

        Returns
        -------
        DecoderModel
        """
        if xp is None:
            import array_api_compat.numpy as xp  # noqa: PLW0127 - the default namespace

        layers, embedding, output_norm, lm_head = layout_gguf_tensors(config, tensors, xp)
        return cls(config, layers, embedding, output_norm, lm_head, tokenizer=tokenizer)

    def make_cache(self, method: str = "dense", *, window_options: dict[str, Any] | None = None, **options: Any) -> Any:
        """A cache of this model's geometry: ``arraykv.make_cache(method, num_layers=..., ...)``.

        For a model with sliding-window layers, a :class:`~arraykv.HybridCache`: the global
        layers in ``method`` (with ``options``), the sliding layers in a window cache holding
        their last ``sliding_window`` tokens (``window_options``: its ``storage``, by default
        :func:`~arraykv.caches.hybrid.default_window_storage` of ``method``, and
        ``rollback_tokens``).
        """
        from ...caches import make_cache
        from ...ops.pending import wait as wait_for_kernels

        wait_for_kernels(method)  # its kernels compiling in another process (decoder.precompile)
        c = self.config
        geometry = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        if not c.hybrid:
            if window_options is not None:
                raise ValueError(f"window_options apply to sliding-window layers; {c.name!r} has none")
            return make_cache(method, **geometry, **options)
        wopts = dict(window_options or {})
        if "rollback_tokens" in options:
            wopts.setdefault("rollback_tokens", options["rollback_tokens"])
        return make_cache(
            "hybrid",
            **geometry,
            layer_types=c.layer_types,
            window=c.sliding_window,
            full_method=method,
            full_options=options,
            window_options=wopts,
        )

    # -- building blocks -------------------------------------------------------------
    def _ensure_rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        c = self.config
        self._cos, self._sin = rope_tables(self.xp, self._dev, length, c.head_dim, c.rope_theta)
        self._rope = {"full_attention": (self._cos, self._sin)}
        if c.hybrid:
            self._rope["sliding_attention"] = rope_tables(self.xp, self._dev, length, c.head_dim, c.rope_local_theta)
        self._rope_len = length

    def _rmsnorm(self, x: Any, w: Any) -> Any:
        xp = self._ops
        ms = xp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / xp.sqrt(ms + self.config.rms_eps)) * w

    def _qkv(self, lw: LayerWeights, h: Any, start: int, layer: int = 0) -> tuple[Any, Any, Any]:
        xp = self._ops
        c = self.config
        b, t = int(h.shape[0]), int(h.shape[1])
        qkv = xp.matmul(h, lw.wqkv)  # (b, t, (H + 2Hkv) * d)
        if lw.bqkv is not None:
            qkv = qkv + lw.bqkv
        qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = xp.permute_dims(xp.reshape(qkv[..., :qd], (b, t, c.num_heads, c.head_dim)), (0, 2, 1, 3))
        k = xp.permute_dims(xp.reshape(qkv[..., qd : qd + kd], (b, t, c.num_kv_heads, c.head_dim)), (0, 2, 1, 3))
        v = xp.permute_dims(xp.reshape(qkv[..., qd + kd :], (b, t, c.num_kv_heads, c.head_dim)), (0, 2, 1, 3))
        if lw.q_norm is not None:
            q, k = self._rmsnorm(q, lw.q_norm), self._rmsnorm(k, lw.k_norm)  # per head, over its channels
        cos, sin = self._rope[self._kinds[layer]]
        return apply_rope(xp, q, cos, sin, start), apply_rope(xp, k, cos, sin, start), v

    def _mlp(self, lw: LayerWeights, x: Any) -> Any:
        xp = self._ops
        f = self.config.ffn_size
        h = self._rmsnorm(x, lw.ffn_norm)
        gu = xp.matmul(h, lw.wgu)
        g, u = gu[..., :f], gu[..., f:]
        if self.arch.activation == "gelu_tanh":
            act = 0.5 * g * (1.0 + xp.tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g))))
        else:
            act = g / (1.0 + xp.exp(-g))
        out = xp.matmul(act * u, lw.wdown)
        return out if lw.post_ffn_norm is None else self._rmsnorm(out, lw.post_ffn_norm)

    def _out_proj(self, lw: LayerWeights, o: Any) -> Any:
        xp = self._ops
        b, h, t, d = (int(s) for s in o.shape)
        o = xp.reshape(xp.permute_dims(o, (0, 2, 1, 3)), (b, t, h * d))
        out = xp.matmul(o, lw.wo)
        return out if lw.post_attn_norm is None else self._rmsnorm(out, lw.post_attn_norm)

    def _attend_chunk(self, q: Any, k: Any, v: Any, bias: Any, layer: int = 0, start: int = 0) -> Any:
        """Causal prefill attention (:func:`~arraykv.integrations.common.layer_attention.attend_chunk`), (b, H, t, d).

        ``k``/``v`` hold the last ``n`` positions before ``start + t``; a sliding layer's
        queries see the last ``sliding_window`` of them (:func:`.attention.window_mask`).
        """
        window = self.config.window_of(layer)
        t, n = int(q.shape[2]), int(k.shape[2])
        if window and n > window:  # the last query sees the last `window` keys: some key is out of reach
            m = window_mask(self.xp, self._dev, t, n, start + t - n, start, window)
            return attend_chunk(self._ops, q, k, v, bias, self._scale, in_place=self._numpy, full_mask=m)
        return attend_chunk(
            self._ops,
            q,
            k,
            v,
            bias,
            self._scale,
            in_place=self._numpy,
            mask=lambda t, total: causal_mask(self.xp, self._dev, t, total),
        )

    def _logits(self, x: Any) -> Any:
        xp = self._ops
        h = self._rmsnorm(x, self.output_norm)
        head = self.embedding if self.lm_head is None else self.lm_head
        return xp.matmul(h, xp.matrix_transpose(head))

    # -- token ids in, logits out ----------------------------------------------------
    def _ids(self, token_ids: Any) -> tuple[Any, bool]:
        """Token ids as a (batch, t) int64 array in the weights' namespace, and whether input was 1-D."""

        a = _compat.to_numpy(token_ids) if _is_array(token_ids) else np.asarray(token_ids)
        if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
            raise TypeError(f"token_ids must be integers, received dtype {a.dtype}")
        if a.ndim not in (1, 2):
            raise ValueError(f"token_ids must have shape (tokens,) or (batch, tokens), received {a.shape}")
        if a.shape[-1] == 0:
            raise ValueError("token_ids must hold at least one token")
        vocab = self.config.vocab_size
        if a.min() < 0 or a.max() >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), received values in [{a.min()}, {a.max()}]")
        flat = a.ndim == 1
        a2 = a[None, :] if flat else a
        return self.xp.asarray(a2.astype(np.int64), device=self._dev), flat

    def _check_room(self, start: int, t: int) -> None:
        limit = self.config.context_length
        if start + t > limit:
            raise ValueError(
                f"{start} cached tokens + {t} new ones exceed the model's context length of {limit}; "
                "shorten the prompt, generate fewer tokens or reset the cache"
            )
        self._ensure_rope(min(limit, max(2 * (start + t), 256)))

    def _embed(self, ids: Any) -> Any:
        xp = self._ops
        b, t = int(ids.shape[0]), int(ids.shape[1])
        x = xp.take(self.embedding, xp.reshape(ids, (-1,)), axis=0)
        if self.arch.embed_scale:
            x = x * self._embed_scale
        return xp.reshape(x, (b, t, self.config.hidden_size))

    def forward(self, token_ids: Any, cache: Any = None) -> Any:
        """Logits for every position of ``token_ids``.

        Parameters
        ----------
        token_ids : sequence of int or integer array, shape (tokens,) or (batch, tokens)
        cache : CompressedKVCache, optional
            Without a cache, exact causal attention over ``token_ids`` alone (nothing is kept).
            With one, the tokens continue the sequence it holds: a single token after earlier
            ones goes through :meth:`decode`, anything else through :meth:`prefill`.

        Returns
        -------
        array, shape (tokens, vocab) or (batch, tokens, vocab), float32
        """
        if cache is None:  # exact causal attention through a throwaway dense cache
            return self.prefill(token_ids, self.make_cache("dense"))
        n = _as_len(token_ids)
        if n == 1 and cache.seq_len(0) > 0:
            return self.decode(token_ids, cache)
        return self.prefill(token_ids, cache)

    def prefill(
        self,
        token_ids: Any,
        cache: Any,
        *,
        chunk_size: int | None = None,
        logits: str = "all",
        prompt_store: str = "exact",
    ) -> Any:
        """Run ``token_ids`` through the model, storing their K/V with ``cache.prefill``.

        Parameters
        ----------
        token_ids : sequence of int or integer array, shape (tokens,) or (batch, tokens)
        cache : CompressedKVCache
            Continued from the length of its layer 0.
        chunk_size : int, optional
            Feed the tokens in chunks of at most this many, each chunk one ``cache.prefill``
            call per layer continuing the sequence; attention scores then take
            ``(batch, heads, chunk_size, total)`` instead of ``(batch, heads, tokens, tokens)``.
            None (default) feeds them all at once.
        logits : {"all", "last"}, default "all"
            "last" computes the output head for the last position only (all logits of an 8k
            prompt would take 1.6 GB).
        prompt_store : {"exact", "chunks"}, default "exact"
            "exact": when the tokens take more than one chunk, the layers whose cache compresses
            hold the prompt's keys and values exactly (float16) while its chunks run, and store
            them compressed in one piece at the end
            (:class:`~arraykv.integrations.common.prompt_stage.PromptStage`), so every prompt token is
            computed as with an exact cache. "chunks": each chunk is stored as it comes and
            later chunks attend to the compressed earlier ones (no float copy of the prompt).

        Returns
        -------
        array, float32
            ``logits="all"``: shape (tokens, vocab) or (batch, tokens, vocab);
            ``logits="last"``: shape (vocab,) or (batch, vocab).

        Notes
        -----
        With the exact cache (``dense``) a chunked prefill equals the one-shot one to float
        rounding. With a compressed cache and ``prompt_store="chunks"`` later chunks attend to the
        stored form of earlier ones; with ``"exact"`` they attend to the prompt's float16 keys
        and values, and the cache calibrates on the whole prompt (its queries sampled,
        :data:`~arraykv.integrations.common.prompt_stage.QUERY_SAMPLE` positions per layer).
        """
        check_chunk("chunk_size", chunk_size)
        if not isinstance(logits, str) or logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', received {logits!r}")
        if not isinstance(prompt_store, str) or prompt_store not in ("exact", "chunks"):
            raise ValueError(f"prompt_store must be 'exact' or 'chunks', received {prompt_store!r}")
        ids, flat = self._ids(token_ids)
        start = _cache_len(cache, self.config.num_layers)
        t = int(ids.shape[1])
        self._check_room(start, t)
        step = t if chunk_size is None else chunk_size
        parts = []
        stage = None
        if prompt_store == "exact" and t > step and any(stages_layer(cache, i) for i in range(len(self.layers))):
            stage = PromptStage(cache, len(self.layers), t)
        target = cache if stage is None else stage
        with undo_on_failure(cache, start):
            for s in range(0, t, step):
                e = min(s + step, t)
                x = self._embed(ids[:, s:e])
                for i in range(len(self.layers)):
                    x = self.prefill_layer(i, x, target, start + s)
                if logits == "all":
                    parts.append(self._logits(x))
                elif e == t:
                    parts.append(self._logits(x[:, -1:, :])[:, 0, :])
            if stage is not None:
                stage.commit()
        out = parts[0] if len(parts) == 1 else self._ops.concat(parts, axis=1)
        return out[0] if flat else out

    def prefill_layer(self, i: int, x: Any, cache: Any, start: int) -> Any:
        """Layer ``i`` for hidden states ``x`` (batch, t, hidden) at positions ``start ..``, stored
        with one ``cache.prefill`` and attending causally over what it returns; the hidden states after it."""
        lw = self.layers[i]
        q, k, v = self._qkv(lw, self._rmsnorm(x, lw.attn_norm), start, i)
        r = cache.prefill(i, k, v, q)
        x = x + self._out_proj(lw, self._attend_chunk(q, r.k, r.v, r.logit_bias, i, start))
        return x + self._mlp(lw, x)

    def decode_layer(self, i: int, x: Any, cache: Any, start: int) -> Any:
        """Layer ``i`` for hidden states ``x`` (batch, t, hidden) at positions ``start ..``, each
        token stored in order with one ``cache.decode`` (a :class:`~arraykv.Fused` answer used as
        the attention output); the hidden states after it."""
        xp = self._ops
        lw = self.layers[i]
        window = self.config.window_of(i)
        q, k, v = self._qkv(lw, self._rmsnorm(x, lw.attn_norm), start, i)
        outs = []
        for j in range(int(x.shape[1])):
            qj, kj, vj = q[:, :, j : j + 1, :], k[:, :, j : j + 1, :], v[:, :, j : j + 1, :]
            res = cache.decode(i, kj, vj, qj, self._attend)
            if isinstance(res, Fused):
                if window and start + j + 1 > window and not _holds_window(cache, i, window):
                    raise ValueError(
                        f"layer {i} attends through a window of {window} tokens, but the cache attended over all "
                        f"{start + j + 1}; use model.make_cache(method), which holds the window"
                    )
                outs.append(res.output)
            else:
                r = res.result
                rk, rv, bias = r.k, r.v, r.logit_bias
                if window and int(rk.shape[2]) > window:  # a cache that holds more than the window
                    rk, rv = rk[:, :, -window:, :], rv[:, :, -window:, :]
                    bias = None if bias is None else bias[..., -window:]
                outs.append(attend_one(xp, qj, rk, rv, bias, self._scale))
        x = x + self._out_proj(lw, outs[0] if len(outs) == 1 else xp.concat(outs, axis=2))
        return x + self._mlp(lw, x)

    def decode(self, token_id: Any, cache: Any) -> Any:
        """One decode step: store the token's K/V with ``cache.decode`` and return its logits.

        Parameters
        ----------
        token_id : int, sequence of one int, or integer array of shape (batch,) or (batch, 1)
            An int or a length-1 sequence means batch 1.
        cache : CompressedKVCache
            Holding the earlier tokens (at least one).

        Returns
        -------
        array, shape (vocab,) for batch 1 given as an int or 1-element sequence, else (batch, vocab)
        """

        if isinstance(token_id, (int, np.integer)):
            ids, single = self._ids([[int(token_id)]])[0], True
        else:
            a = _compat.to_numpy(token_id) if _is_array(token_id) else np.asarray(token_id)
            single = a.ndim <= 1 and a.size == 1
            if a.ndim == 2 and a.shape[1] != 1:
                raise ValueError(f"decode takes one token per sequence, received shape {a.shape}")
            ids, _ = self._ids(a.reshape(-1, 1) if a.ndim <= 1 else a)
        start = _cache_len(cache, self.config.num_layers)
        if start == 0:
            raise ValueError("decode needs a cache holding earlier tokens; call prefill with the prompt first")
        self._check_room(start, 1)
        x = self._embed(ids)
        with undo_on_failure(cache, start):
            for i in range(len(self.layers)):
                x = self.decode_layer(i, x, cache, start)
        out = self._logits(x)[:, 0, :]
        return out[0] if single else out

    # -- text generation: GenerationFront.generate over these steps ------------------
    def _cache_layers(self) -> int:
        return self.config.num_layers

    def _check_generation_room(self, prompt_tokens: int, max_new_tokens: int) -> None:
        limit = self.config.context_length
        if prompt_tokens + max_new_tokens > limit:
            raise ValueError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the context "
                f"length of {limit}; shorten the prompt or ask for fewer tokens"
            )

    def _prompt_logits(self, ids: list[int], cache: Any, chunk: int | None) -> Any:
        return self.prefill(ids, cache, chunk_size=chunk, logits="last")

    def _stored_prompt_logits(self, store: Any, ids: list[int], cache: Any, chunk: int | None) -> Any:
        from ...store.prefix import as_prefix_store  # the prompt in the store's segments

        return as_prefix_store(store).prefill(self, ids, cache, chunk_size=chunk)

    def _token_logits(self, token: int, cache: Any) -> Any:
        return self.decode(token, cache)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"DecoderModel({c.arch}: {c.name!r}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_heads}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, vocab={c.vocab_size})"
        )


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _as_len(token_ids: Any) -> int:
    if isinstance(token_ids, int):
        return 1
    shape = getattr(token_ids, "shape", None)
    if shape is not None:
        return int(shape[-1]) if len(shape) else 1
    return len(token_ids)


def _holds_window(cache: Any, layer: int, window: int) -> bool:
    """Whether ``cache`` serves ``layer`` from a window cache of ``window`` tokens (whose fused
    decode attends over exactly the last ``window`` tokens)."""
    part = serving_cache(cache, layer)
    return getattr(part, "window", None) == window and getattr(part, "method", None) == "window"
