"""Keys of stored prefixes: a namespace (model, cache, prefill schedule) and a hash chain over token chunks.

A prefix of ``j`` whole chunks of ``chunk_tokens`` token ids has the key ``h_j``::

    h_0 = SHA-256(namespace JSON)
    h_j = SHA-256(h_{j-1} || ids[(j-1)·chunk : j·chunk] as little-endian int64)

so ``h_j`` names the namespace and every token before it, and a prompt finds its longest
stored prefix by computing its chain once (one hash per chunk) and looking the keys up from
the longest. The namespace JSON holds what the stored bytes depend on:

- ``model``: the model's identity (:func:`model_identity`, or :func:`gguf_identity` of its file,
  or any string the caller gives);
- ``cache``: the cache's full ``get_config()`` (method, options, seed, geometry);
- ``schedule``: how the prefix was prefilled (``chunk_tokens``, the decoder's ``chunk_size``
  and ``prompt_store``), the array library it ran on, and the arraykv version and file format
  version, since a later release may compute other bits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import weakref
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from .. import _compat
from .._types import Array

__all__ = ["model_identity", "gguf_identity", "onnx_identity", "namespace_root", "chain_keys", "SAMPLE_VALUES"]

#: Values of each weight tensor that :func:`model_identity` hashes (evenly spaced).
SAMPLE_VALUES = 4096

_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensors(model: Any) -> Iterator[tuple[str, Array]]:
    """``(name, array)`` of a decoder's weights, in a fixed order."""
    yield "embedding", model.embedding
    yield "output_norm", model.output_norm
    if getattr(model, "lm_head", None) is not None:
        yield "lm_head", model.lm_head
    for i, lw in enumerate(model.layers):
        fields = dataclasses.fields(lw) if dataclasses.is_dataclass(lw) else ()
        for f in fields:
            a = getattr(lw, f.name)
            if a is not None:
                yield f"layers.{i}.{f.name}", a


def model_identity(model: Any) -> str:
    """A hex digest naming a decoder's configuration and weights (memoised per model object).

    Parameters
    ----------
    model : DecoderModel
        A decoder of :mod:`arraykv.integrations.llama` (``config``, ``embedding``,
        ``output_norm``, ``lm_head``, ``layers``).

    Returns
    -------
    str
        SHA-256, hex, of the configuration and, for every weight tensor, its name, shape, dtype
        and :data:`SAMPLE_VALUES` evenly spaced values. Two models that differ in any sampled
        weight get different identities; for a digest of every byte use :func:`gguf_identity`
        on the file and pass it as ``model_id``.
    """
    try:
        known: str = _IDENTITIES[model]
        return known
    except (KeyError, TypeError):
        pass
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "embedding") or not hasattr(model, "layers"):
        raise TypeError(
            f"model must be a DecoderModel (config, embedding, layers), received {type(model).__name__}; "
            "pass model_id= for another engine"
        )
    h = hashlib.sha256()
    cfg = dataclasses.asdict(cast(Any, config)) if dataclasses.is_dataclass(config) else dict(vars(config))
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, a in _tensors(model):
        shape = tuple(int(s) for s in a.shape)
        h.update(f"{name}:{shape}:{a.dtype}".encode())
        n = 1
        for s in shape:
            n *= s
        flat = a.reshape(-1) if hasattr(a, "reshape") else a
        step = max(1, n // SAMPLE_VALUES)
        sample = np.ascontiguousarray(_compat.to_numpy(flat[::step]))
        h.update(sample.tobytes())
    digest = h.hexdigest()
    try:
        _IDENTITIES[model] = digest
    except TypeError:
        pass
    return digest


def gguf_identity(path: str | os.PathLike, *, block: int = 1 << 22) -> str:
    """SHA-256 (hex) of a model file's every byte: an identity that two copies of one file share.

    Parameters
    ----------
    path : str or path-like
        The file (a GGUF model, or any other).
    block : int, default 4194304
        Bytes read at a time (4 MiB).

    Returns
    -------
    str
        The 64 hexadecimal digits of the file's SHA-256.
    """
    h = hashlib.sha256()
    with open(os.fspath(path), "rb") as f:
        while True:
            chunk = f.read(block)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def onnx_identity(proto: Any, base_dir: str | None = None) -> str:
    """A hex digest naming an ONNX graph: its nodes whole and a sample of every initializer.

    Parameters
    ----------
    proto : onnx.ModelProto
        The model as given to an ONNX Runtime engine (before any rewriting).
    base_dir : str, optional
        The folder of the model's file, for initializers whose data was left in external data
        files (``onnx.load(..., load_external_data=False)``): their samples are read from those
        files, so the digest is the one of the model loaded whole.

    Returns
    -------
    str
        SHA-256, hex, of the graph's inputs, outputs and nodes (serialized whole: operators,
        attributes, wiring) and, for every initializer, its name, dimensions, data type and
        :data:`SAMPLE_VALUES` evenly spaced 4-byte words of its data (its ``raw_data``, the first
        word first, or its serialized form where the values are in typed fields). Two graphs
        that differ in their structure or in any sampled weight get different identities; for
        a digest of every byte use :func:`gguf_identity` on the ``.onnx`` file (and its external
        data) and pass it as ``model_id``.

    Raises
    ------
    ValueError
        An initializer's data is in an external file and ``base_dir`` is not given.
    """
    graph = getattr(proto, "graph", None)
    if graph is None or not hasattr(graph, "initializer"):
        raise TypeError(f"proto must be an onnx.ModelProto, received {type(proto).__name__}")
    h = hashlib.sha256()
    for part in (graph.input, graph.output, graph.node):
        for item in part:
            h.update(item.SerializeToString(deterministic=True))
    for init in graph.initializer:
        h.update(f"{init.name}:{tuple(init.dims)}:{init.data_type}".encode())
        data = _external_bytes(init, base_dir)
        if data is None:
            data = np.frombuffer(init.raw_data or init.SerializeToString(deterministic=True), dtype=np.uint8)
        h.update(len(data).to_bytes(8, "little"))
        words = data[: len(data) // 4 * 4].reshape(-1, 4)
        step = max(1, len(words) // SAMPLE_VALUES)
        h.update(np.ascontiguousarray(words[::step]).tobytes())
    return h.hexdigest()


def _external_bytes(tensor: Any, base_dir: str | None) -> Any:
    """A tensor's bytes in its external data file (a read-only map), or None if they are in the proto."""
    if tensor.data_location != 1 or not tensor.external_data:  # onnx.TensorProto.EXTERNAL
        return None
    from onnx.external_data_helper import ExternalDataInfo  # only a proto that has external data gets here

    info = ExternalDataInfo(tensor)
    if base_dir is None:
        raise ValueError(f"initializer {tensor.name!r} is in external data {info.location!r}; pass base_dir")
    path = os.path.join(base_dir, info.location)
    offset = int(info.offset or 0)
    length = int(info.length) if info.length is not None else os.path.getsize(path) - offset
    if length == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(length,))


def namespace_root(model_id: str, cache_config: dict, schedule: dict) -> bytes:
    """``h_0``: the SHA-256 digest (32 bytes) of the namespace (module docstring).

    Parameters
    ----------
    model_id : str
    cache_config : dict
        The cache's ``get_config()``.
    schedule : dict
        JSON-serializable facts of how prefixes are computed.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, received {model_id!r}")
    text = json.dumps({"model": model_id, "cache": cache_config, "schedule": schedule}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).digest()


def chain_keys(root: bytes, ids: Any, chunk_tokens: int) -> list:
    """The keys (hex) of the prefixes of ``ids`` that end at a chunk boundary, shortest first.

    Parameters
    ----------
    root : bytes
        :func:`namespace_root`.
    ids : sequence of int
        The prompt's token ids.
    chunk_tokens : int
        Tokens per chunk.

    Returns
    -------
    list of str
        ``len(ids) // chunk_tokens`` keys; entry ``j - 1`` names the first ``j * chunk_tokens`` ids.
    """
    a = np.asarray(ids, dtype="<i8").reshape(-1)
    keys = []
    h = root
    for j in range(len(a) // chunk_tokens):
        h = hashlib.sha256(h + a[j * chunk_tokens : (j + 1) * chunk_tokens].tobytes()).digest()
        keys.append(h.hex())
    return keys
