"""Prefix stores for the ONNX Runtime engines: a graph's identity and the store-backed prompt.

:class:`~arraykv.integrations.ort_graph_decoder.OrtGraphDecoder` and
:class:`~arraykv.integrations.onnxruntime.OrtKVDecoder` take ``generate(..., store=...)`` as the
NumPy decoder does (:mod:`arraykv.store.prefix`). Both store each prompt chunk in the cache as it
comes, so a prompt that runs in store segments of ``chunk_tokens`` (a multiple of the prefill
chunk) makes exactly the calls of a run without a store: a restored prefix continues bit for bit
as that run.

The key's namespace names the engine (``"onnxruntime-graph"`` or ``"onnxruntime-hook"``), the
prefill chunk and the graph: the in-graph decoder reads the model whatever form it is given in
and names it by :func:`~arraykv.store.keys.onnx_identity` (so a file, its bytes and its
``ModelProto`` share entries); the hook, which does not parse the file, by the SHA-256 of the
model's bytes (a file and its bytes share entries). A ready ``InferenceSession`` has nothing to
name; a store then needs ``PrefixStore(..., model_id=...)``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

__all__ = ["graph_identity", "store_prefill"]


def graph_identity(model: Any, base_dir: str | None = None) -> Callable[[], str] | None:
    """A function giving ``model``'s identity for store keys, or None for a ready session.

    Parameters
    ----------
    model : str, PathLike, bytes or onnx.ModelProto
        What the engine was built from. A file is hashed when the identity is first asked
        for (once; its external data files, if any, are not read); bytes and a proto now, since
        the engine does not keep them.
    base_dir : str, optional
        For a proto loaded without its external data: the folder of its file (see
        :func:`~arraykv.store.keys.onnx_identity`).
    """
    from ..store.keys import gguf_identity, onnx_identity

    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        memo: list = []

        def of_file() -> str:
            if not memo:
                memo.append("sha256:" + gguf_identity(path))
            return memo[0]

        return of_file
    if isinstance(model, (bytes, bytearray, memoryview)):
        digest = "sha256:" + hashlib.sha256(model).hexdigest()
        return lambda: digest
    if hasattr(model, "graph"):
        digest = "onnx:" + onnx_identity(model, base_dir)
        return lambda: digest
    return None


def store_prefill(
    store: Any,
    engine: str,
    identity: Callable[[], str] | None,
    cache: Any,
    ids: list,
    prefill_chunk: int | None,
    run_chunk: Callable[[Any], Any],
) -> Any:
    """The logits (vocab,) of the prompt's last position, the prompt run through ``store``.

    Parameters
    ----------
    store : PrefixStore, folder or ``redis://`` URL
    engine : str
        The engine's name in the key namespace.
    identity : callable or None
        :func:`graph_identity` of the engine's model (None: the store must carry ``model_id``).
    cache : LayeredCache or HybridCache
        Empty.
    ids : list of int
        The prompt.
    prefill_chunk : int or None
        Tokens per engine call within a segment (None: one call per segment).
    run_chunk : callable
        ``run_chunk(int64 array (1, t))`` runs the engine on a chunk after what ``cache`` holds
        and returns its logits (1, t, vocab).
    """
    from .._compat import to_numpy
    from ..store.prefix import as_prefix_store
    from .generation import chunked_logits

    ps = as_prefix_store(store)
    if ps.model_id is None and identity is None:
        raise ValueError(
            "a decoder built from a ready InferenceSession has no model bytes to name in store keys; "
            "pass PrefixStore(backend, model_id=...) with a name for the model"
        )
    if prefill_chunk is not None and ps.chunk_tokens % prefill_chunk:
        raise ValueError(
            f"the store's chunk_tokens ({ps.chunk_tokens}) must be a multiple of prefill_chunk ({prefill_chunk}), "
            "so that a prompt runs in the same engine calls with and without stored prefixes"
        )
    model_id = ps.model_id if ps.model_id is not None else identity()
    keys = ps.engine_keys(
        model_id, cache, ids, {"engine": engine, "chunk_size": prefill_chunk, "array_library": "numpy"}
    )

    def run_segment(seg: list) -> Any:
        return to_numpy(chunked_logits(run_chunk, seg, prefill_chunk))[0, -1]

    return ps.prefill_segments(run_segment, ids, cache, keys)
