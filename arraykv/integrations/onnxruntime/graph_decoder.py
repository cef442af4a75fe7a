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
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..common.generation import cache_length, undo_on_failure
from ..common.optional import require
from .cache_operator import CacheSlot, register, run_prompt, session_options
from .engine import OrtEngine, declared_dim, int_types, token_feeds, token_ids
from .graph_files import rewritten_session
from .graph_rewrite import rewrite_with_cache_op
from .prefix_store import graph_identity, store_prefill

__all__ = ["OrtGraphDecoder"]


class OrtGraphDecoder(OrtEngine):
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
        self.num_kv_heads = declared_dim(dims[1], num_kv_heads, "num_kv_heads")
        self.head_dim = declared_dim(dims[3], head_dim, "head_dim")
        self._int_type = int_types({i.name: i for i in self.session.get_inputs()})
        outputs = [o.name for o in self.session.get_outputs()]
        self.logits_name = "logits" if "logits" in outputs else outputs[0]

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
        return self._run(token_ids(input_ids), cache, mode, cache)

    def _run(self, ids: Any, cache: Any, mode: str, into: Any) -> Any:
        """:meth:`step` on checked ``ids``, the nodes storing into ``into``: ``cache``, or a
        :class:`~arraykv.integrations.common.prompt_stage.PromptStage` standing in for it."""
        t = ids.shape[1]
        if mode == "decode" and t != 1:
            raise ValueError(f"a decode step takes one token per sequence, received {t}")
        past_len = cache_length(into, self.num_layers)
        if mode == "decode" and past_len == 0:
            raise ValueError("decode needs a cache holding earlier tokens; call prefill first")
        feeds = token_feeds(ids, past_len, self._int_type)
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
            token_ids(input_ids),
            cache,
            self.num_layers,
            chunk_size=chunk_size,
            prompt_store=prompt_store,
            logits=logits,
        )

    def decode(self, input_ids: Any, cache: Any) -> Any:
        """One token per sequence (an int, or shape (batch,) or (batch, 1)); logits (batch, 1, vocab)."""
        ids = np.asarray(input_ids).reshape(-1, 1)
        return self.step(ids, cache, mode="decode")

    # -- generation: GenerationFront.generate over these steps and OrtEngine's ---------
    def _prompt_logits(self, ids: list[int], cache: Any, chunk: int | None) -> Any:
        return self._prompt_segment(np.asarray([ids], dtype=np.int64), cache, chunk)

    def _stored_prompt_logits(self, store: Any, ids: list[int], cache: Any, chunk: int | None) -> Any:
        def run(a: Any) -> Any:
            return self._prompt_segment(a, cache, chunk)

        return store_prefill(store, "onnxruntime-graph", self._identity, cache, ids, chunk, run, segments=True)

    def _prompt_segment(self, ids: Any, cache: Any, chunk: int | None) -> Any:
        """The logits (vocab,) of the last of ``ids`` (1, t), a prompt or a store segment, staged
        exactly when it takes several chunks."""
        return self.prefill(ids, cache, chunk_size=chunk, logits="last")[0]


def _spinning(options: Any) -> str | None:
    """``options``' ``session.intra_op.allow_spinning`` entry, or None when it is not set (spinning)."""
    try:
        return str(options.get_session_config_entry("session.intra_op.allow_spinning"))
    except Exception:  # noqa: BLE001 - onnxruntime raises a plain RuntimeError/Fail for a missing key
        return None
