"""Keys of stored prefixes: a namespace (model, cache, prefill schedule) and a hash chain over token chunks.

A prefix of ``j`` whole chunks of ``chunk_tokens`` token ids has the chain digest ``h_j``::

    h_0 = SHA-256(namespace JSON)
    h_j = SHA-256(h_{j-1} || ids[(j-1)·chunk : j·chunk] as little-endian int64)

so ``h_j`` names the namespace and every token before it, and a prompt finds its longest
stored prefix by computing its chain once (one hash per chunk) and looking the keys up from
the longest. A store without a secret uses ``h_j`` (hex) as the key; a store with one uses
``HMAC(secret, h_j)`` (:class:`~arraykv.store.binding.Tenant`), so its keys say nothing to
whoever lacks the secret. The namespace JSON holds what the stored bytes depend on:

- ``model``: the model's identity (:func:`model_identity`: every byte of every weight, or
  :func:`gguf_identity` of its file, or any string the caller gives);
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
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from .. import _compat
from .._types import Array

__all__ = [
    "model_identity",
    "gguf_identity",
    "file_digest",
    "onnx_identity",
    "onnx_identity_later",
    "namespace_root",
    "chain_digests",
    "chain_keys",
]

_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IDENTITY_LOCK = threading.Lock()
#: Digests of files by their identity (path, device, inode, size, modification time).
_FILE_DIGESTS: dict = {}


def _tensors(model: Any) -> Iterator[tuple[str, Array]]:
    """``(name, array)`` of a decoder's weights, in a fixed order; a TypeError where a layer is not
    a dataclass of arrays (its weights could not all be named)."""
    yield "embedding", model.embedding
    yield "output_norm", model.output_norm
    if getattr(model, "lm_head", None) is not None:
        yield "lm_head", model.lm_head
    for i, lw in enumerate(model.layers):
        if not dataclasses.is_dataclass(lw):
            raise TypeError(
                f"layer {i} of the model is a {type(lw).__name__}, not a dataclass of weight arrays: "
                "its weights cannot be named; pass model_id="
            )
        for f in dataclasses.fields(lw):
            a = getattr(lw, f.name)
            if a is None:
                continue
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(
                    f"layers.{i}.{f.name} is a {type(a).__name__}, not an array: the model's weights "
                    "cannot be named; pass model_id="
                )
            yield f"layers.{i}.{f.name}", a


def model_identity(model: Any) -> str:
    """A hex digest naming a decoder's configuration and every byte of its weights (once per model object).

    Parameters
    ----------
    model : DecoderModel
        A decoder of :mod:`arraykv.integrations.decoder.model` (``config``, ``embedding``,
        ``output_norm``, ``lm_head``, ``layers``).

    Returns
    -------
    str
        SHA-256, hex, of the configuration and, for every weight tensor, its name, shape, dtype
        and all its bytes. Two models that differ in any weight get different identities. The
        digest is computed on the first call for a model object and remembered for the object's
        life (weights are read-only once loaded): one SHA-256 pass, SmolLM2-135M's 538 MB of
        float32 weights in 0.7 s at 780 MB/s.

    Raises
    ------
    TypeError
        ``model`` is not such a decoder, or holds weights that are not arrays: it cannot be
        named, and ``PrefixStore(..., model_id=...)`` must name it.
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
    with _IDENTITY_LOCK:  # two threads' first prompts hash the weights once
        try:
            known = _IDENTITIES[model]
            return known
        except (KeyError, TypeError):
            pass
        h = hashlib.sha256()
        cfg = dataclasses.asdict(cast(Any, config)) if dataclasses.is_dataclass(config) else dict(vars(config))
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        for name, a in _tensors(model):
            shape = tuple(int(s) for s in a.shape)
            h.update(f"{name}:{shape}:{a.dtype}".encode())
            host = np.ascontiguousarray(_compat.to_numpy(a))
            h.update(host.reshape(-1).view(np.uint8).data)
        digest = h.hexdigest()
        try:
            _IDENTITIES[model] = digest
        except TypeError:
            pass
    return digest


def file_digest(path: str | os.PathLike, *, block: int = 1 << 22) -> str:
    """SHA-256 (hex) of a file's every byte, remembered by the file's identity.

    Parameters
    ----------
    path : str or path-like
        The file.
    block : int, default 4194304
        Bytes read at a time (4 MiB).

    Returns
    -------
    str
        The 64 hexadecimal digits of the file's SHA-256. A second call for the same file
        (same real path, device, inode, size and modification time in nanoseconds) returns the
        remembered digest without reading it; a file replaced or written since is read again
        (unless it was rewritten in place to the same size within the file system's timestamp
        resolution, as for any tool that trusts modification times).
    """
    real = os.path.realpath(os.fspath(path))
    with open(real, "rb") as f:
        st = os.fstat(f.fileno())
        ident = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        known = _FILE_DIGESTS.get(ident)
        if known is not None:
            return str(known)
        h = hashlib.sha256()
        while True:
            chunk = f.read(block)
            if not chunk:
                break
            h.update(chunk)
        after = os.fstat(f.fileno())
    digest = h.hexdigest()
    if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):  # not written while read
        _FILE_DIGESTS[ident] = digest
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
        The 64 hexadecimal digits of the file's SHA-256 (:func:`file_digest`: read once per file
        identity in a process).
    """
    return file_digest(path, block=block)


def onnx_identity(proto: Any, base_dir: str | None = None) -> str:
    """A hex digest naming an ONNX graph: its nodes and every byte of every initializer.

    Parameters
    ----------
    proto : onnx.ModelProto
        The model as given to an ONNX Runtime engine (before any rewriting).
    base_dir : str, optional
        The folder of the model's file, for initializers whose data was left in external data
        files (``onnx.load(..., load_external_data=False)``): their bytes are read from those
        files (each region hashed once per file identity), so the digest is the one of the
        model loaded whole.

    Returns
    -------
    str
        SHA-256, hex, of the graph's inputs, outputs and nodes (serialized whole: operators,
        attributes, wiring) and, for every initializer, its name, dimensions, data type and the
        SHA-256 of its data (its ``raw_data``, or its serialized form where the values are in
        typed fields, or its external data region). Two graphs that differ in their structure
        or in any weight get different identities.

    Raises
    ------
    ValueError
        An initializer's data is in an external file and ``base_dir`` is not given.
    """
    return onnx_identity_later(proto, base_dir)()


def onnx_identity_later(proto: Any, base_dir: str | None = None) -> Callable[[], str]:
    """:func:`onnx_identity` in two steps: what the proto holds now, its external data when asked.

    Parameters
    ----------
    proto : onnx.ModelProto
        As for :func:`onnx_identity`; not kept.
    base_dir : str, optional
        As for :func:`onnx_identity`.

    Returns
    -------
    callable
        ``identity() -> str``, :func:`onnx_identity`'s digest. The graph and the data held in the
        proto are hashed now; the regions of external data files (most of a large model's bytes)
        on the first call, so an engine that never uses a store never reads them.

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
    parts: list = []  # per initializer: its name line, then its data digest or where to read it
    for init in graph.initializer:
        parts.append(f"{init.name}:{tuple(init.dims)}:{init.data_type}".encode())
        region = _external_region(init, base_dir)
        if region is None:
            parts.append(hashlib.sha256(init.raw_data or init.SerializeToString(deterministic=True)).digest())
        else:
            parts.append(region)
    memo: list = []

    def identity() -> str:
        if not memo:
            whole = h.copy()
            for part in parts:
                whole.update(part if isinstance(part, bytes) else _region_digest(*part))
            memo.append(whole.hexdigest())
        return str(memo[0])

    return identity


def _external_region(tensor: Any, base_dir: str | None) -> tuple | None:
    """``(name, path, offset, length or None)`` of a tensor's external data, or None if it is in the proto."""
    if tensor.data_location != 1 or not tensor.external_data:  # onnx.TensorProto.EXTERNAL
        return None
    from onnx.external_data_helper import ExternalDataInfo  # only a proto that has external data gets here

    info = ExternalDataInfo(tensor)
    if base_dir is None:
        raise ValueError(f"initializer {tensor.name!r} is in external data {info.location!r}; pass base_dir")
    path = os.path.realpath(os.path.join(base_dir, info.location))
    st = os.stat(path)  # the file as it is now: read later only if it is still this file
    seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return tensor.name, path, int(info.offset or 0), None if info.length is None else int(info.length), seen


def _region_digest(name: str, path: str, offset: int, length: int | None, seen: tuple) -> bytes:
    """SHA-256 of ``length`` bytes of ``path`` at ``offset`` (to its end: None), remembered by file identity.

    ``seen`` is the file's ``(device, inode, size, mtime_ns)`` when the proto was read: a file
    replaced or written since is refused rather than named for weights it no longer holds.
    """
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != seen:
            raise ValueError(
                f"initializer {name!r}: its external data file {path!r} changed since the model was read; "
                "its identity cannot be taken from it (pass model_id=)"
            )
        length = st.st_size - offset if length is None else length
        ident = ("region", path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, offset, length)
        known = _FILE_DIGESTS.get(ident)
        if known is not None:
            return bytes(known)
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise ValueError(
                f"initializer {name!r}: external data {path!r} holds {st.st_size} bytes, "
                f"the tensor claims {length} at offset {offset}"
            )
        h = hashlib.sha256()
        if length:
            data = np.memmap(f, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
            h.update(data.data)
            del data
    out = h.digest()
    _FILE_DIGESTS[ident] = out
    return out


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


def chain_digests(root: bytes, ids: Any, chunk_tokens: int) -> list:
    """The chain digests ``h_1 .. h_m`` (32 bytes each) of the prefixes of ``ids`` that end at a chunk boundary.

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
    list of bytes
        ``len(ids) // chunk_tokens`` digests; entry ``j - 1`` names the first ``j * chunk_tokens`` ids.
    """
    a = np.asarray(ids, dtype="<i8").reshape(-1)
    out = []
    h = root
    for j in range(len(a) // chunk_tokens):
        h = hashlib.sha256(h + a[j * chunk_tokens : (j + 1) * chunk_tokens].tobytes()).digest()
        out.append(h)
    return out


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
        ``len(ids) // chunk_tokens`` keys (:func:`chain_digests` in hex); entry ``j - 1`` names
        the first ``j * chunk_tokens`` ids. These are the keys of a store without a secret; a
        store with one derives its keys from the digests with it
        (:meth:`~arraykv.store.binding.Tenant.key`).
    """
    return [d.hex() for d in chain_digests(root, ids, chunk_tokens)]
