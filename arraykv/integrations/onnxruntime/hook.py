"""Drive an ONNX Runtime decoder with its KV cache held compressed in any :class:`CompressedKVCache`.

An ONNX decoder exported "with past" takes ``past_key_values.{i}.key`` / ``.value`` inputs of
shape ``(batch, kv_heads, past, head_dim)`` and returns ``present.{i}.key`` / ``.value`` of shape
``(batch, kv_heads, past + new, head_dim)`` (the names Hugging Face Optimum and
onnxruntime-genai use). :class:`OrtKVDecoder` discovers those names, the number of layers and
the head layout from the session, and after each step

1. takes the ``new`` tokens' keys and values out of ``present.*``,
2. stores them in the cache (``cache.append(layer, k_new, v_new, q)`` and a read-back of what it
   holds, ``cache.dequantize``; ``cache.prefill`` for a cache of the protocol only),
3. feeds those reconstructed K/V as the next step's ``past_key_values.*``.

So the graph always attends over what the cache actually kept: the dense cache reproduces the
plain ORT loop exactly; a compressed cache shows its effect on the model's outputs.

With a cache that offers ``append``, ``stable_length`` and ``dequantize(layer, start)``
(:class:`~arraykv.protocol.IncrementalKVCache`, every built-in cache), step 2 reads back only
what changed: the hook keeps the last past it fed and the number of its leading tokens that the
cache promises never to change (:meth:`~arraykv.caches.LayeredCache.stable_length`), and
decodes the rest — the new tokens and those still in a float16 window — instead of
reconstructing the whole past every step.

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
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._compat import to_numpy
from ...protocol import INCREMENTAL, supports
from ..common.generation import cache_length, chunked_logits, held_rewrites, undo_on_failure
from ..common.optional import require
from .engine import OrtEngine, declared_dim, int_types, token_feeds, token_ids
from .graph_files import rewritten_session
from .graph_queries import with_query_outputs
from .kv_names import PRESENT_NAME, discover_kv_names
from .prefix_store import graph_identity, store_prefill

__all__ = ["OrtKVDecoder"]


class OrtKVDecoder(OrtEngine):
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
        if queries not in ("auto", True, False):
            raise ValueError(f"queries must be 'auto', True or False, received {queries!r}")
        self.query_outputs: list[str] | None = None
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
        self._int_type = int_types(inputs)
        self.logits_name = "logits" if "logits" in outputs else outputs[0]
        self.input_names = list(inputs)
        past = inputs["past_key_values.0.key"]
        shape = list(past.shape)
        if len(shape) != 4:
            raise ValueError(
                f"past_key_values.0.key must have 4 dimensions (batch, kv_heads, past, head_dim), "
                f"the model declares {shape}"
            )
        self.num_kv_heads = declared_dim(shape[1], num_kv_heads, "num_kv_heads")
        self.head_dim = declared_dim(shape[3], head_dim, "head_dim")
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
        held = self._held.get(cache, {})
        out = []
        for i in range(self.num_layers):
            if cache.seq_len(i) == 0:
                empty = np.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype)
                out.append((empty, empty))
                continue
            h = held.get(i)
            if h is not None and h[2] == cache.seq_len(i) and h[4] == held_rewrites(cache):
                out.append((h[0], h[1]))
                continue
            r = cache.dequantize(i) if supports(cache, INCREMENTAL) else None
            if r is None:
                raise ValueError("this cache was filled elsewhere and cannot be read back; reset it first")
            out.append((to_numpy(r.k), to_numpy(r.v)))
        return out

    def _store(self, cache: Any, i: int, k_new: Any, v_new: Any, q: Any, prev: tuple | None) -> tuple:
        """Store layer ``i``'s new K/V in ``cache``; return ``(k, v, tokens, stable, rewrites)`` of
        its next past (``rewrites``: :func:`~arraykv.integrations.common.generation.held_rewrites`).

        The next past is what the cache holds after the store. A cache's ``prefill`` answers a
        prompt with the prompt's K/V as given (its own attention is exact), which is not what
        a compressed cache kept; so a cache that can be read back stores with ``append`` and is
        read back: from the stable prefix of the kept past (incremental), or whole.
        """
        kv_cache: Any = cache  # the contract's methods, whatever supports() narrows ``cache`` to
        if not supports(cache, INCREMENTAL):  # the protocol only: what prefill answers is all there is
            r = kv_cache.prefill(i, k_new, v_new, q)
            return to_numpy(r.k), to_numpy(r.v), int(kv_cache.seq_len(i)), 0, None
        stable = prev[3] if self.incremental and prev is not None else 0
        cache.append(i, k_new, v_new, q)
        tail = cache.dequantize(i, stable)
        if tail is None:  # None only for a layer holding nothing, which append just filled
            raise RuntimeError(f"layer {i}: the cache holds no tokens after append")
        k, v = to_numpy(tail.k), to_numpy(tail.v)
        if stable and prev is not None:
            k = np.concatenate([prev[0][:, :, :stable], k], axis=2)
            v = np.concatenate([prev[1][:, :, :stable], v], axis=2)
        return k, v, int(kv_cache.seq_len(i)), int(cache.stable_length(i)), held_rewrites(cache)

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
        ids = token_ids(input_ids)
        batch, t = ids.shape
        past_len = cache_length(cache, self.num_layers)
        feeds = token_feeds(ids, past_len, self._int_type)
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
        rewrites = held_rewrites(cache)
        with undo_on_failure(cache, past_len):  # layer by layer: a failure puts every layer back
            for i, (k_new, v_new) in enumerate(new):
                prev = before.get(i)
                if prev is not None and (past_len == 0 or prev[2] != past_len or prev[4] != rewrites):
                    prev = None  # not the past this step ran on: read the layer back whole
                held[i] = self._store(cache, i, k_new, v_new, queries[i], prev)
        self._held[cache] = held
        return res[0]

    def _queries(self, found: list, batch: int, t: int) -> list:
        """Each layer's queries for the cache: the graph's (checked), or zeros where it exposes none."""
        if not found:
            zero = np.zeros((batch, self.num_kv_heads, t, self.head_dim), dtype=self.dtype)
            return [zero] * self.num_layers
        names = self.query_outputs or []  # set whenever the graph returns queries
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
                    f"the graph's queries of layer {i} ({names[i]}) have shape {q.shape}, "
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
        ids = np.asarray(input_ids).reshape(-1, 1)
        if cache.seq_len(0) == 0:
            raise ValueError("decode needs a cache holding earlier tokens; call prefill first")
        return self.step(ids, cache)

    # -- generation: GenerationFront.generate over these steps and OrtEngine's ---------
    def _prompt_logits(self, ids: list[int], cache: Any, chunk: int | None) -> Any:
        return to_numpy(chunked_logits(lambda a: self.step(a, cache), ids, chunk))[0, -1]

    def _stored_prompt_logits(self, store: Any, ids: list[int], cache: Any, chunk: int | None) -> Any:
        return store_prefill(
            store, "onnxruntime-hook", self._identity, cache, ids, chunk, lambda a: self.step(a, cache)
        )
