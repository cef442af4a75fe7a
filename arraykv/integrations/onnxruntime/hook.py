"""Drive an ONNX Runtime decoder with its KV cache held compressed in any :class:`CompressedKVCache`.

An ONNX decoder exported "with past" takes ``past_key_values.{i}.key`` / ``.value`` inputs of
shape ``(batch, kv_heads, past, head_dim)`` and returns ``present.{i}.key`` / ``.value`` of shape
``(batch, kv_heads, past + new, head_dim)`` (the names Hugging Face Optimum and
onnxruntime-genai use). :class:`OrtKVDecoder` discovers those names, the number of layers and
the head layout from the session, and after each step

1. takes the ``new`` tokens' keys and values out of ``present.*``,
2. stores them with ``cache.prefill(layer, k_new, v_new, q)`` (which returns the K/V of every
   token the layer holds, reconstructed by the cache),
3. feeds those reconstructed K/V as the next step's ``past_key_values.*``.

So the graph always attends over what the cache actually kept: the dense cache reproduces the
plain ORT loop exactly; a compressed cache shows its effect on the model's outputs.

With a cache that offers ``append``, ``stable_length`` and ``dequantize(layer, start)`` (every
built-in cache), step 2 reads back only what changed: the hook keeps the last past it fed and
the number of its leading tokens that the cache promises never to change
(:meth:`~arraykv.caches.LayeredCache.stable_length`), and decodes the rest — the new tokens
and those still in a float16 window — instead of reconstructing the whole past every step.

Notes
-----
The graph computes attention itself, so a cache's :class:`~arraykv.Fused` output and its
``logit_bias`` (TurboQuant's QJL correction) cannot be used here; only the reconstructed K/V
enter the model.

Queries: a ``pq``/``pqo``/``tq`` cache weights its key channels by the queries' statistics,
which an exported graph does not return. With ``queries="auto"`` (the default) the hook looks
in the graph for each layer's queries (the left operand of the ``MatMul`` that takes the
layer's keys: :mod:`arraykv.integrations.onnxruntime.graph_queries`), adds them to the graph's outputs and
hands them to the cache, so "pqo4" here is the quantizer the NumPy decoder's pqo4 is. Where
they cannot be found (a fused attention operator, or the model given as a ready session) the
cache gets zero queries of shape ``(batch, kv_heads, new, head_dim)`` and keeps every key
channel weight at 1 — a different quantizer. :attr:`OrtKVDecoder.query_outputs` says which
case a decoder is in. Measured on SmolLM2-135M (the graph of ``examples/export_smollm2_onnx.py``,
512 teacher-forced tokens of the shipped text): mean KL between the NumPy decoder's pqo4 and
the hook's pqo4 2.5e-4 with the graph's queries, 4.9e-3 without; against the exact cache the
hook's pqo2 has KL 0.058 with them (the NumPy decoder's pqo2: 0.056) and 0.091 without. On
the same model exported by Optimum (``text-generation-with-past``; its queries are the
``Mul`` by the square root of the scale before the score ``MatMul``) the queries are found in
all 30 layers, dense logits are within 9.0e-5 of the NumPy decoder's, and the two pqo4 are
2.6e-4 apart with the queries, 4.9e-3 without (``tests/integrations/test_onnx_optimum.py``).

Memory: during a loop the hook holds the float32 past it feeds the graph (it must hand ONNX
Runtime dense ``past_key_values``) *as well as* the compressed cache, so it holds more than a
dense cache, not less. At the SmolLM2-135M geometry (30 layers, 3 KV heads, head_dim 64) the
fed past is 22.5 / 90 / 360 MiB at 512 / 2048 / 8192 tokens, and a pqo4 cache adds 3.8 / 12.7
/ 48.6 MiB (int4: 4.2 / 14.8 / 57.0; ``memory_usage()`` of caches filled with random K/V).
What compression saves an ONNX Runtime user is the memory *between* calls: the hook keeps
the fed past as long as the cache object lives, unless :meth:`OrtKVDecoder.release` drops it
(:meth:`OrtKVDecoder.held_bytes` says how much it holds), so a parked conversation holds only
the compressed bytes, in memory or as a file (``cache.save(path)``, then
``arraykv.load(path)``); the next step rebuilds the past from the cache: one read-back of
every layer, at the SmolLM2 geometry 17 / 51 / 238 ms for pqo4 at 512 / 2048 / 8192 tokens
(int4: 12 / 44 / 178; one thread of a 2-core VM).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..common.generation import (
    cache_length,
    check_sampling,
    chunked_logits,
    generate_tokens,
    prompt_ids,
    undo_on_failure,
)
from ..common.optional import require
from .graph_files import rewritten_session
from .graph_queries import with_query_outputs
from .kv_names import PRESENT_NAME, discover_kv_names
from .prefix_store import graph_identity, store_prefill

__all__ = ["OrtKVDecoder"]


class OrtKVDecoder:
    """An ONNX Runtime decode loop whose KV cache lives in an arraykv cache.

    Parameters
    ----------
    model : str, PathLike, bytes or onnxruntime.InferenceSession
        The decoder: a file, serialized ``ModelProto`` bytes, or a session.
    num_kv_heads, head_dim : int, optional
        Needed only when the session's past inputs have symbolic head dimensions.
    providers : list of str, optional
        Execution providers when a session is created here (default: CPU).
    incremental : bool, default True
        Read back only the tokens whose reconstruction may have changed (see the module
        notes) when the cache supports it; ``False`` reconstructs every layer's whole past
        each step (the same past, to float32 rounding).
    queries : {"auto", True, False}, default "auto"
        Hand the cache the graph's own attention queries (see the module notes): ``"auto"``
        where they can be found, ``True`` to require it (a ValueError otherwise), ``False``
        for zero queries.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim : int
    query_outputs : list of str or None
        The graph tensors read as each layer's queries, or None (zero queries).
    dtype : numpy.dtype
        Of the past/present tensors.
    input_names, logits_name : list of str, str

    Examples
    --------
    >>> dec = OrtKVDecoder("decoder.onnx")                   # doctest: +SKIP
    >>> cache = dec.make_cache("pqo4")                       # doctest: +SKIP
    >>> logits = dec.prefill([[1, 2, 3]], cache)             # (1, 3, vocab)  doctest: +SKIP
    >>> logits = dec.decode([[4]], cache)                    # (1, 1, vocab)  doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        providers: Sequence[str] | None = None,
        incremental: bool = True,
        queries: Any = "auto",
    ):
        ort = require("onnxruntime", "onnx")
        import numpy as np

        if queries not in ("auto", True, False):
            raise ValueError(f"queries must be 'auto', True or False, received {queries!r}")
        self.query_outputs = None
        self._identity = None if isinstance(model, ort.InferenceSession) else graph_identity(model)
        if isinstance(model, ort.InferenceSession):
            if queries is True:
                raise ValueError(
                    "queries=True needs the model as a file or bytes: a ready session's outputs cannot be extended"
                )
            sess = model
        else:
            src = model if isinstance(model, (bytes, bytearray)) else str(model)
            providers = list(providers or ["CPUExecutionProvider"])
            if queries is False:
                sess = ort.InferenceSession(src, providers=providers)
            else:  # opened from a file on the model's own weights (graph_files), not from bytes
                sess, _, _, self.query_outputs = rewritten_session(
                    src, lambda p: with_query_outputs(p, queries is True), ort.SessionOptions(), providers
                )
        self.session = sess
        inputs = {i.name: i for i in sess.get_inputs()}
        outputs = [o.name for o in sess.get_outputs()]
        self.num_layers = discover_kv_names(list(inputs), outputs)
        if "input_ids" not in inputs:
            raise ValueError("the ONNX model has no input_ids input; only token-id decoders are supported")
        self.logits_name = "logits" if "logits" in outputs else outputs[0]
        self.input_names = list(inputs)
        past = inputs["past_key_values.0.key"]
        shape = list(past.shape)
        if len(shape) != 4:
            raise ValueError(
                f"past_key_values.0.key must have 4 dimensions (batch, kv_heads, past, head_dim), "
                f"the model declares {shape}"
            )
        self.num_kv_heads = _dim(shape[1], num_kv_heads, "num_kv_heads")
        self.head_dim = _dim(shape[3], head_dim, "head_dim")
        types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
        if past.type not in types:
            raise ValueError(f"past_key_values.0.key has type {past.type}; float, float16 or double is supported")
        self.dtype = np.dtype(types[past.type])
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be a bool, received {type(incremental).__name__}")
        self.incremental = incremental
        # cache -> {layer: (k, v, tokens, stable)}: the past fed last, how many tokens it covers,
        # and how many of its leading tokens the cache will never reconstruct differently.
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._int_type = {
            name: (np.int32 if inputs[name].type == "tensor(int32)" else np.int64)
            for name in ("input_ids", "attention_mask", "position_ids")
            if name in inputs
        }

    def make_cache(self, method: str = "dense", **options: Any):
        """A cache of this decoder's geometry (``arraykv.make_cache`` with layers/heads/head_dim filled)."""
        from ...caches import make_cache

        return make_cache(
            method, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, **options
        )

    def held_bytes(self, cache: Any) -> int:
        """Bytes of the float past this decoder keeps for ``cache`` between steps (0 when none)."""
        return sum(int(h[0].nbytes) + int(h[1].nbytes) for h in self._held.get(cache, {}).values())

    def release(self, cache: Any) -> int:
        """Drop the float past kept for ``cache``; returns the bytes released.

        Between calls only the compressed cache then remains (a parked conversation, without
        writing a file); the next step rebuilds the past from the cache with one full
        read-back per layer and continues as if it had been kept (to float32 rounding).
        """
        n = self.held_bytes(cache)
        self._held.pop(cache, None)
        return n

    # -- one step -------------------------------------------------------------------
    def _past(self, cache: Any, batch: int) -> list:
        """The K/V to feed as past, per layer: what the cache holds, or empty arrays."""
        import numpy as np

        from ..._compat import to_numpy

        held = self._held.get(cache, {})
        out = []
        for i in range(self.num_layers):
            if cache.seq_len(i) == 0:
                empty = np.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype)
                out.append((empty, empty))
                continue
            h = held.get(i)
            if h is not None and h[2] == cache.seq_len(i):
                out.append((h[0], h[1]))
                continue
            r = cache.dequantize(i) if hasattr(cache, "dequantize") else None
            if r is None:
                raise ValueError("this cache was filled elsewhere and cannot be read back; reset it first")
            out.append((to_numpy(r.k), to_numpy(r.v)))
        return out

    def _store(self, cache: Any, i: int, k_new: Any, v_new: Any, q: Any, prev: tuple | None) -> tuple:
        """Store layer ``i``'s new K/V in ``cache``; return ``(k, v, tokens, stable)`` of its next past."""
        import numpy as np

        from ..._compat import to_numpy

        incremental = (
            self.incremental and prev is not None and hasattr(cache, "append") and hasattr(cache, "stable_length")
        )
        if not incremental:
            r = cache.prefill(i, k_new, v_new, q)
            return to_numpy(r.k), to_numpy(r.v), int(cache.seq_len(i)), 0
        k_prev, v_prev, _, stable = prev
        cache.append(i, k_new, v_new, q)
        tail = cache.dequantize(i, stable)
        k = np.concatenate([k_prev[:, :, :stable], to_numpy(tail.k)], axis=2)
        v = np.concatenate([v_prev[:, :, :stable], to_numpy(tail.v)], axis=2)
        return k, v, int(cache.seq_len(i)), int(cache.stable_length(i))

    def step(self, input_ids: Any, cache: Any) -> Any:
        """Run the graph on ``input_ids`` after the tokens ``cache`` holds; store the new K/V.

        Parameters
        ----------
        input_ids : array-like of int, shape (batch, new_tokens)
        cache : CompressedKVCache
            Of this decoder's geometry. Continued from the length of its layer 0.

        Returns
        -------
        numpy.ndarray, shape (batch, new_tokens, vocab)
            The ``logits`` output.
        """
        import numpy as np

        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[1] == 0 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"input_ids must be integers of shape (batch, new_tokens), received {ids.shape} {ids.dtype}"
            )
        batch, t = ids.shape
        past_len = cache_length(cache, self.num_layers)
        feeds = {"input_ids": ids.astype(self._int_type["input_ids"])}
        if "attention_mask" in self._int_type:
            feeds["attention_mask"] = np.ones((batch, past_len + t), dtype=self._int_type["attention_mask"])
        if "position_ids" in self._int_type:
            pos = np.arange(past_len, past_len + t, dtype=self._int_type["position_ids"])
            feeds["position_ids"] = np.broadcast_to(pos, (batch, t)).copy()
        for i, (k, v) in enumerate(self._past(cache, batch)):
            feeds[f"past_key_values.{i}.key"] = k
            feeds[f"past_key_values.{i}.value"] = v
        names = (
            [self.logits_name]
            + [PRESENT_NAME.format(i=i, kind=kd) for i in range(self.num_layers) for kd in ("key", "value")]
            + list(self.query_outputs or ())
        )
        res = self.session.run(names, feeds)
        new = self._new_tokens(res, batch, past_len, t, bool(getattr(cache, "check_finite", True)))
        queries = self._queries(res[1 + 2 * self.num_layers :], batch, t)
        before = self._held.get(cache, {})
        held = {}
        with undo_on_failure(cache, past_len):  # layer by layer: a failure puts every layer back
            for i, (k_new, v_new) in enumerate(new):
                prev = before.get(i)
                if prev is not None and (past_len == 0 or prev[2] != past_len):
                    prev = None  # not the past this step ran on: read the layer back whole
                held[i] = self._store(cache, i, k_new, v_new, queries[i], prev)
        self._held[cache] = held
        return res[0]

    def _queries(self, found: list, batch: int, t: int) -> list:
        """Each layer's queries for the cache: the graph's (checked), or zeros where it exposes none."""
        import numpy as np

        if not found:
            zero = np.zeros((batch, self.num_kv_heads, t, self.head_dim), dtype=self.dtype)
            return [zero] * self.num_layers
        out = []
        for i, q in enumerate(found):
            q = np.asarray(q)
            # (batch, heads, t, d), or a KV head's group folded into the rows: (batch, kv_heads, g·t, d)
            if (
                q.ndim != 4
                or q.shape[0] != batch
                or q.shape[3] != self.head_dim
                or q.shape[1] % self.num_kv_heads
                or q.shape[2] % t
            ):
                raise ValueError(
                    f"the graph's queries of layer {i} ({self.query_outputs[i]}) have shape {q.shape}, "
                    f"not (batch {batch}, a multiple of {self.num_kv_heads} heads, a multiple of {t} "
                    f"tokens, {self.head_dim}); construct the decoder with queries=False; nothing was "
                    "stored"
                )
            heads = q.shape[1] * (q.shape[2] // t)
            out.append(np.ascontiguousarray(q, dtype=self.dtype).reshape(batch, heads, t, self.head_dim))
        return out

    def _new_tokens(self, res: list, batch: int, past_len: int, t: int, finite: bool) -> list:
        """Every layer's new K/V out of the ``present.*`` outputs, all checked before any is stored.

        A step stores layer by layer, so a layer refused after an earlier one was stored would
        leave the layers at different lengths; checking every layer first keeps a refused step
        from changing the cache. ``finite``: refuse NaN/Inf (as a cache with ``check_finite``
        would, but before anything is stored).
        """
        import numpy as np

        want = (batch, self.num_kv_heads, past_len + t, self.head_dim)
        new = []
        for i in range(self.num_layers):
            pair = []
            for kind, a in (("key", res[1 + 2 * i]), ("value", res[2 + 2 * i])):
                if a.ndim != 4 or a.shape[2] != past_len + t:
                    raise ValueError(
                        f"present.{i}.{kind} has shape {a.shape}: {a.shape[2] if a.ndim == 4 else '?'} "
                        f"tokens, expected past {past_len} + new {t}; nothing was stored"
                    )
                if tuple(a.shape) != want:
                    raise ValueError(f"present.{i}.{kind} has shape {a.shape}, expected {want}; nothing was stored")
                x = np.ascontiguousarray(a[:, :, past_len:, :])
                if finite and not np.isfinite(x).all():
                    raise ValueError(
                        f"present.{i}.{kind} holds non-finite values (NaN or Inf) for the new tokens; "
                        "nothing was stored, every layer of the cache is as it was"
                    )
                pair.append(x)
            new.append(tuple(pair))
        return new

    def prefill(self, input_ids: Any, cache: Any) -> Any:
        """The prompt: ``step`` on an empty cache. Returns logits (batch, tokens, vocab)."""
        if cache.seq_len(0) != 0:
            raise ValueError("prefill needs an empty cache; call cache.reset() first")
        return self.step(input_ids, cache)

    def decode(self, input_ids: Any, cache: Any) -> Any:
        """One token per sequence after the prompt. Returns logits (batch, 1, vocab)."""
        import numpy as np

        ids = np.asarray(input_ids).reshape(-1, 1)
        if cache.seq_len(0) == 0:
            raise ValueError("decode needs a cache holding earlier tokens; call prefill first")
        return self.step(ids, cache)

    def generate(
        self,
        prompt: Any,
        max_new_tokens: int = 32,
        *,
        cache: Any = None,
        method: str = "dense",
        eos_id: int | None = None,
        stop_at_eos: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        prefill_chunk: int | None = 512,
        store: Any = None,
    ) -> list:
        """Greedy or sampled generation for one sequence.

        The convention every engine shares (:mod:`arraykv.integrations.common.generation`): the same
        arguments as :meth:`arraykv.integrations.decoder.model.DecoderModel.generate`.

        Parameters
        ----------
        prompt : sequence of int
            Token ids (a decoder has no tokenizer).
        max_new_tokens : int, default 32
        cache : CompressedKVCache, optional
            An empty cache of this decoder's geometry; by default ``self.make_cache(method)``.
        method : str, default "dense"
            Cache method when ``cache`` is not given.
        eos_id : int, optional
            The end-of-sequence token; None means none is known, so generation runs for
            ``max_new_tokens``.
        stop_at_eos : bool, default True
            Stop right after producing ``eos_id`` (it ends the returned list).
        temperature, top_k, seed, on_token
            Sampling and streaming, as in :meth:`DecoderModel.generate
            <arraykv.integrations.decoder.model.DecoderModel.generate>` (temperature 0, the default, is greedy).
        prefill_chunk : int or None, default 512
            The prompt goes through :meth:`step` in chunks of this many tokens; None feeds it
            in one piece.
        store : PrefixStore, folder or ``redis://`` URL, optional
            Reuse the longest stored prefix of the prompt, prefill only the rest and store new
            prefixes (:mod:`arraykv.integrations.onnxruntime.prefix_store`); the result equals a run without a
            store bit for bit. A decoder built from a ready session needs the store's ``model_id``.

        Returns
        -------
        list of int
            The new token ids (the prompt excluded).
        """

        from ..._compat import to_numpy

        ids = prompt_ids(prompt, None)
        temperature = check_sampling(max_new_tokens, temperature, top_k, prefill_chunk)
        if cache is None:
            cache = self.make_cache(method)
        elif cache_length(cache, self.num_layers) != 0:
            raise ValueError("cache must be empty; call cache.reset() first")

        def prefill_last(p: list) -> Any:
            if store is not None:
                return store_prefill(
                    store, "onnxruntime-hook", self._identity, cache, p, prefill_chunk, lambda a: self.step(a, cache)
                )
            return to_numpy(chunked_logits(lambda a: self.step(a, cache), p, prefill_chunk))[0, -1]

        with undo_on_failure(cache, 0):  # a failed generation leaves the cache empty, as it came
            return generate_tokens(
                prefill_last,
                lambda tok: to_numpy(self.decode([tok], cache))[0, -1],
                ids,
                max_new_tokens,
                eos=eos_id,
                stop_at_eos=stop_at_eos,
                temperature=temperature,
                top_k=top_k,
                seed=seed,
                on_token=on_token,
            )


def _dim(declared: Any, given: int | None, name: str) -> int:
    if isinstance(declared, int) and declared > 0:
        if given is not None and given != declared:
            raise ValueError(f"{name}={given} disagrees with the model's past_key_values shape ({declared})")
        return declared
    if given is None:
        raise ValueError(f"the model's past_key_values inputs have a symbolic {name} ({declared!r}); pass {name}=")
    return int(given)
