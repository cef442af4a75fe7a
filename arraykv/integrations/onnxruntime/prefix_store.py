"""Prefix stores for the ONNX Runtime engines: a graph's identity and the store-backed prompt.

:class:`~arraykv.integrations.onnxruntime.graph_decoder.OrtGraphDecoder` and
:class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder` take ``generate(..., store=...)`` as the
NumPy decoder does (:mod:`arraykv.store.prefix`). A prompt runs in store segments of
``chunk_tokens`` (a multiple of the prefill chunk), each segment in prefill chunks: the hook
stores each chunk as it comes, the in-graph decoder stages a segment's chunks exactly and stores
the segment at its end (as the NumPy decoder does). A restored prefix then continues bit for bit
as a run of every segment without a store (:mod:`arraykv.store.prefix`); with the exact staging
that run is not the one of the whole prompt in one stage, whose staging spans all its chunks.

The key's namespace names the engine (``"onnxruntime-graph"`` or ``"onnxruntime-hook"``), the
prefill chunk and the graph: the in-graph decoder reads the model whatever form it is given in
and names it by :func:`~arraykv.store.keys.onnx_identity` (so a file, its bytes and its
``ModelProto`` share entries); the hook by the SHA-256 of the model's bytes and of the external
data files its initializers name (a file that names none and its bytes share entries). Both
cover every byte of every weight. A ready ``InferenceSession`` has nothing to
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
        What the engine was built from. A file is read when the identity is first asked for
        (once per file identity in a process, :func:`~arraykv.store.keys.file_digest`): the
        file's bytes and those of the external data files its initializers name; bytes and a
        proto are hashed now, since the engine does not keep them.
    base_dir : str, optional
        For a proto loaded without its external data: the folder of its file (see
        :func:`~arraykv.store.keys.onnx_identity`).

    Returns
    -------
    callable or None
        ``identity() -> str``: every byte of the graph and its weights enters it.
    """
    from ...store.keys import file_digest, onnx_identity_later

    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        memo: list = []

        def of_file() -> str:
            if not memo:
                memo.append("sha256:" + file_digest(path) + "".join(":" + d for d in _external_digests(path)))
            return str(memo[0])

        return of_file
    if isinstance(model, (bytes, bytearray, memoryview)):
        digest = "sha256:" + hashlib.sha256(model).hexdigest()
        return lambda: digest
    if hasattr(model, "graph"):
        later = onnx_identity_later(model, base_dir)  # external data read on first use only
        return lambda: "onnx:" + later()
    return None


def _external_digests(path: str) -> list:
    """The digests of the external data files an ONNX file's initializers name (sorted by name)."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(path))
    locations: set[str] = set()
    for init in proto.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(e.value for e in init.external_data if e.key == "location")
    del proto
    from ...store.keys import file_digest

    return [loc + "=" + file_digest(os.path.join(folder, loc)) for loc in sorted(locations)]


def store_prefill(
    store: Any,
    engine: str,
    identity: Callable[[], str] | None,
    cache: Any,
    ids: list[int],
    prefill_chunk: int | None,
    run_chunk: Callable[[Any], Any],
    *,
    segments: bool = False,
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
    segments : bool, default False
        True: ``run_chunk`` takes a whole segment, runs it in chunks of ``prefill_chunk`` itself
        (the in-graph decoder stages them exactly, ``prompt_store="exact"``) and returns the
        logits of its last position (vocab,). The keys then name that schedule, so entries
        stored chunk by chunk are not reused for it.
    """
    import numpy as np

    from ..._compat import to_numpy
    from ...store.prefix import as_prefix_store
    from ..common.generation import chunked_logits

    ps = as_prefix_store(store)
    named = ps.model_id
    name_model: Callable[[], str]
    if named is not None:
        name_model = lambda: named  # noqa: E731
    elif identity is not None:
        name_model = identity
    else:
        raise ValueError(
            "a decoder built from a ready InferenceSession has no model bytes to name in store keys; "
            "pass PrefixStore(backend, model_id=...) with a name for the model"
        )
    if prefill_chunk is not None and ps.chunk_tokens % prefill_chunk:
        raise ValueError(
            f"the store's chunk_tokens ({ps.chunk_tokens}) must be a multiple of prefill_chunk ({prefill_chunk}), "
            "so that a prompt runs in the same engine calls with and without stored prefixes"
        )
    model_id = name_model()  # (hashing the model's files) once the arguments are checked
    schedule = {"engine": engine, "chunk_size": prefill_chunk, "array_library": "numpy"}
    if segments:
        schedule["prompt_store"] = "exact"
    keys = ps.engine_keys(model_id, cache, ids, schedule)

    def run_segment(seg: list) -> Any:
        if segments:
            return to_numpy(run_chunk(np.asarray([seg], dtype=np.int64)))
        return to_numpy(chunked_logits(run_chunk, seg, prefill_chunk))[0, -1]

    return ps.prefill_segments(run_segment, ids, cache, keys)
