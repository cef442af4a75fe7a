"""An ONNX Runtime decoder whose attention over the past runs inside the graph, from an arraykv cache.

:class:`OrtGraphDecoder` rewrites a decoder graph exported "with past"
(:func:`arraykv.integrations.onnxruntime.graph_rewrite.rewrite_with_cache_op`): each layer's ``Concat`` of
past and new K/V and the attention over it become one ``ArrayKVAttention`` custom operator
(:mod:`arraykv.integrations.onnxruntime.cache_operator`, run by ``onnxruntime-extensions``) that stores the
new tokens in layer ``i`` of the cache the decoder is given and returns attention computed from
it: a prompt through ``cache.prefill`` and causal attention over what it returns, a decode step
through ``cache.decode`` (the cache's fused kernel where it has one). The rewritten graph has no
``past_key_values.*`` inputs and no ``present.*`` outputs, so during a loop the only K/V held is
the cache's: what a compressed cache saves, it saves during the loop too (the hook,
:class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder`, must feed ONNX Runtime a float past
every step).

The cache is an ordinary Python object outside the session: one decoder serves any number of
caches (conversations), and truncating, forking, saving and loading a cache between calls work
as they do with the NumPy decoder.

Graphs the rewriter does not recognize (a fused attention operator, the past concatenated
elsewhere) raise :class:`~arraykv.integrations.onnxruntime.graph_rewrite.GraphRewriteError` here; the hook
drives those.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..common.generation import cache_length, check_sampling, generate_tokens, prompt_ids, undo_on_failure
from ..common.optional import require
from .cache_operator import CacheSlot, register, run_prompt, session_options
from .graph_files import rewritten_session
from .graph_rewrite import rewrite_with_cache_op
from .prefix_store import graph_identity, store_prefill

__all__ = ["OrtGraphDecoder"]


class OrtGraphDecoder:
    """ONNX Runtime decoding with the KV cache inside the graph, held by an arraykv cache.

    Parameters
    ----------
    model : str, PathLike, bytes or onnx.ModelProto
        A decoder with ``past_key_values.{i}.key/value`` inputs and ``present.{i}.*`` outputs
        (float32), for example ``build_llama_onnx`` of ``examples/export_smollm2_onnx.py``.
    num_kv_heads, head_dim : int, optional
        Needed only when the past inputs have symbolic head dimensions.
    providers : list of str, optional
        Execution providers (default: CPU). The custom operator runs on the CPU.
    options : onnxruntime.SessionOptions, optional
        Session options to start from (the extensions library is registered on them). By
        default, new options with ``session.intra_op.allow_spinning = "0"``: ONNX Runtime's
        threads otherwise keep spinning while the operator's kernels run (measured on SmolLM2,
        pqo4 at 512 tokens, 2 cores: 4.0 tokens/s spinning, 5.2-6.2 not). With spinning off
        the decode kernels use all of Numba's threads (:attr:`CacheSlot.kernels
        <arraykv.integrations.onnxruntime.cache_operator.CacheSlot.kernels>`); options that leave it on get
        serial kernels.
    work_dir : str, optional
        Where the rewritten graph is written while the session opens (default: beside the
        model's data files when it reads them from a folder, else a temporary folder; a full or
        unwritable folder falls back to a temporary one:
        :func:`~arraykv.integrations.onnxruntime.graph_files.rewritten_session`). The
        session is opened from that file, on the original weights files where the model has
        them, so ONNX Runtime does not hold a second copy of the weights (opened from bytes,
        the SmolLM2 graph left the process 1.7 GiB larger). Weights stored inside the model file
        (or a model given as bytes or a proto) are written there once, and removed with the
        folder when the session is open.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim : int
    sites : list of AttentionSite
        What was replaced in each layer (the rewritten graph itself is
        :func:`~arraykv.integrations.onnxruntime.graph_rewrite.rewrite_with_cache_op` of the model; it is not
        kept, the session holds its weights).
    session : onnxruntime.InferenceSession

    Raises
    ------
    GraphRewriteError
        The graph's attention cannot be replaced (see :mod:`arraykv.integrations.onnxruntime.graph_rewrite`).
    ImportError
        ``onnxruntime`` or ``onnxruntime-extensions`` is missing.

    Examples
    --------
    >>> dec = OrtGraphDecoder("decoder.onnx")                # doctest: +SKIP
    >>> cache = dec.make_cache("pqo4")                       # doctest: +SKIP
    >>> logits = dec.prefill([[1, 2, 3]], cache)             # (1, 3, vocab)  doctest: +SKIP
    >>> logits = dec.decode([4], cache)                      # (1, 1, vocab)  doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        providers: Sequence[str] | None = None,
        options: Any = None,
        work_dir: str | None = None,
    ):
        ort = require("onnxruntime", "onnx")
        self._handle = f"arraykv-{uuid.uuid4().hex}"
        if options is None:
            options = ort.SessionOptions()
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._slot = CacheSlot("parallel" if _spinning(options) == "0" else "serial")
        register(self._handle, self._slot)
        self.session, proto, base_dir, self.sites = rewritten_session(
            model,
            lambda p: rewrite_with_cache_op(p, self._handle),  # refuses graphs without a past
            session_options(options),
            providers or ["CPUExecutionProvider"],
            work_dir=work_dir,
        )
        self._identity = graph_identity(proto, base_dir)  # for prefix-store keys
        past = next(vi for vi in proto.graph.input if vi.name == "past_key_values.0.key")
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in past.type.tensor_type.shape.dim]
        del past, proto  # the session holds the weights; keeping the proto would hold them twice
        if len(dims) != 4:
            raise ValueError(
                f"past_key_values.0.key must have 4 dimensions (batch, kv_heads, past, head_dim), "
                f"the model declares {dims}"
            )
        self.num_layers = len(self.sites)
        self.num_kv_heads = _dim(dims[1], num_kv_heads, "num_kv_heads")
        self.head_dim = _dim(dims[3], head_dim, "head_dim")
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "input_ids" not in inputs:
            raise ValueError("the ONNX model has no input_ids input; only token-id decoders are supported")
        outputs = [o.name for o in self.session.get_outputs()]
        self.logits_name = "logits" if "logits" in outputs else outputs[0]
        import numpy as np

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

    def step(self, input_ids: Any, cache: Any, *, mode: str = "prefill") -> Any:
        """Run the graph on ``input_ids`` after the tokens ``cache`` holds, storing their K/V in it.

        Parameters
        ----------
        input_ids : array-like of int, shape (batch, new_tokens)
        cache : CompressedKVCache
            Of this decoder's geometry, holding the same number of tokens for every sequence of
            the batch; continued from the length of its layer 0.
        mode : {"prefill", "decode"}, default "prefill"
            "prefill": every layer stores the tokens with ``cache.prefill`` and attends causally
            over what it returns. "decode": one token per sequence, stored with ``cache.decode``.

        Returns
        -------
        numpy.ndarray, float32, shape (batch, new_tokens, vocab)

        Notes
        -----
        If the run fails anywhere (a layer's cache refuses non-finite keys, ``MemoryError``,
        ``KeyboardInterrupt``), every layer is put back as it was (the step runs in a
        ``cache.transaction()``, :func:`~arraykv.integrations.common.generation.undo_on_failure`) and
        the operator's own exception is raised.
        """
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', received {mode!r}")
        return self._run(_token_ids(input_ids), cache, mode, cache)

    def _run(self, ids: Any, cache: Any, mode: str, into: Any) -> Any:
        """:meth:`step` on checked ``ids``, the nodes storing into ``into``: ``cache``, or a
        :class:`~arraykv.integrations.common.prompt_stage.PromptStage` standing in for it."""
        import numpy as np

        batch, t = ids.shape
        if mode == "decode" and t != 1:
            raise ValueError(f"a decode step takes one token per sequence, received {t}")
        past_len = cache_length(into, self.num_layers)
        if mode == "decode" and past_len == 0:
            raise ValueError("decode needs a cache holding earlier tokens; call prefill first")
        feeds = {"input_ids": ids.astype(self._int_type["input_ids"])}
        if "attention_mask" in self._int_type:
            feeds["attention_mask"] = np.ones((batch, past_len + t), dtype=self._int_type["attention_mask"])
        if "position_ids" in self._int_type:
            pos = np.arange(past_len, past_len + t, dtype=self._int_type["position_ids"])
            feeds["position_ids"] = np.broadcast_to(pos, (batch, t)).copy()
        self._check_geometry(cache)
        slot = self._slot
        slot.cache, slot.mode, slot.error = into, mode, None
        try:
            with undo_on_failure(cache, past_len):
                logits = self.session.run([self.logits_name], feeds)[0]
                if slot.error is not None:  # the operator cannot raise (see cache_operator)
                    raise slot.error
        finally:
            slot.cache, slot.error = None, None
        return logits

    def _check_geometry(self, cache: Any) -> None:
        """A ValueError, before anything runs, when ``cache`` declares another geometry than the graph's."""
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            have = getattr(cache, name, None)
            want = getattr(self, name)
            if isinstance(have, int) and (have < want if name == "num_layers" else have != want):
                raise ValueError(
                    f"the cache has {name}={have}, this graph needs {want}; make it with decoder.make_cache(method)"
                )

    def prefill(
        self,
        input_ids: Any,
        cache: Any,
        *,
        chunk_size: int | None = None,
        prompt_store: str = "exact",
        logits: str = "all",
    ) -> Any:
        """The tokens ``input_ids`` (batch, tokens) after what ``cache`` holds, stored in it.

        ``chunk_size`` (tokens per graph run, None: one run), ``prompt_store`` ("exact": a
        prompt of several chunks is computed over its exact keys and values and stored
        compressed in one piece at its end; "chunks": each chunk stored as it comes) and
        ``logits`` ("all": (batch, tokens, vocab); "last": (batch, vocab)) as in
        :meth:`DecoderModel.prefill <arraykv.integrations.decoder.model.DecoderModel.prefill>`; see
        :func:`~arraykv.integrations.onnxruntime.cache_operator.run_prompt`.
        """
        return run_prompt(
            lambda a, into: self._run(a, cache, "prefill", into),
            _token_ids(input_ids),
            cache,
            self.num_layers,
            chunk_size=chunk_size,
            prompt_store=prompt_store,
            logits=logits,
        )

    def decode(self, input_ids: Any, cache: Any) -> Any:
        """One token per sequence (an int, or shape (batch,) or (batch, 1)); logits (batch, 1, vocab)."""
        import numpy as np

        ids = np.asarray(input_ids).reshape(-1, 1)
        return self.step(ids, cache, mode="decode")

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
            Token ids (a graph has no tokenizer).
        max_new_tokens : int, default 32
        cache : CompressedKVCache, optional
            An empty cache of this decoder's geometry; by default ``self.make_cache(method)``.
        method : str, default "dense"
        eos_id : int or collection of int, optional
            None: generation runs for ``max_new_tokens``.
        stop_at_eos, temperature, top_k, seed, on_token
            As in :meth:`DecoderModel.generate <arraykv.integrations.decoder.model.DecoderModel.generate>`.
        prefill_chunk : int or None, default 512
            The prompt goes through :meth:`prefill` in chunks of this many tokens, computed over
            its exact keys and values and stored compressed at its end (``prompt_store="exact"``);
            None feeds it in one piece.
        store : PrefixStore, folder or ``redis://`` URL, optional
            Reuse the longest stored prefix of the prompt, prefill only the rest and store new
            prefixes (:mod:`arraykv.integrations.onnxruntime.prefix_store`); the result equals a run without a
            store bit for bit. The store's ``chunk_tokens`` must be a multiple of ``prefill_chunk``.

        Returns
        -------
        list of int
            The new token ids (the prompt excluded).
        """

        import numpy as np

        ids = prompt_ids(prompt, None)
        temperature = check_sampling(max_new_tokens, temperature, top_k, prefill_chunk)
        if cache is None:
            cache = self.make_cache(method)
        elif cache_length(cache, self.num_layers) != 0:
            raise ValueError("cache must be empty; call cache.reset() first")

        def run(a: Any) -> Any:  # a prompt or a store segment, staged exactly when it takes several chunks
            return self.prefill(a, cache, chunk_size=prefill_chunk, logits="last")[0]

        def prefill_last(p: list) -> Any:
            if store is not None:
                return store_prefill(
                    store, "onnxruntime-graph", self._identity, cache, p, prefill_chunk, run, segments=True
                )
            return run(np.asarray([p], dtype=np.int64))

        with undo_on_failure(cache, 0):  # a failed generation leaves the cache empty, as it came
            return generate_tokens(
                prefill_last,
                lambda tok: self.decode([tok], cache)[0, -1],
                ids,
                max_new_tokens,
                eos=eos_id,
                stop_at_eos=stop_at_eos,
                temperature=temperature,
                top_k=top_k,
                seed=seed,
                on_token=on_token,
            )


def _token_ids(input_ids: Any) -> Any:
    """``input_ids`` as a NumPy integer array (batch, new_tokens), or a ValueError."""
    import numpy as np

    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be integers of shape (batch, new_tokens), received {ids.shape} {ids.dtype}")
    return ids


def _spinning(options: Any) -> str | None:
    """``options``' ``session.intra_op.allow_spinning`` entry, or None when it is not set (spinning)."""
    try:
        return str(options.get_session_config_entry("session.intra_op.allow_spinning"))
    except Exception:  # noqa: BLE001 - onnxruntime raises a plain RuntimeError/Fail for a missing key
        return None


def _dim(declared: Any, given: int | None, name: str) -> int:
    if isinstance(declared, int) and declared > 0:
        if given is not None and given != declared:
            raise ValueError(f"{name}={given} disagrees with the model's past_key_values shape ({declared})")
        return declared
    if given is None:
        raise ValueError(f"the model's past_key_values inputs have a symbolic {name} ({declared!r}); pass {name}=")
    return int(given)
