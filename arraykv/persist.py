"""Saving and loading caches: prefix caching, moving a cache between processes or devices.

File format (version 1)
-----------------------
::

    magic    8 bytes   b"ARRAYKV\\x00"
    version  4 bytes   little-endian uint32 (1)
    hlen     8 bytes   little-endian uint64, length of the header
    header   hlen      UTF-8 JSON: {"config": {...}, "layers": [...], "arrays": [...]}
    data               the arrays' bytes, C order, at the offsets the header gives
    digest   32 bytes  SHA-256 of everything before it

``config`` is :meth:`~arraykv.caches.LayeredCache.get_config` (method name and options, so
the loader rebuilds the same codec: same seed, same rotation). ``layers`` holds, per layer,
``null`` for an empty layer or ``{"length", "batch", "dtype", "arrays": [names]}``. Each entry
of ``arrays`` is ``{"layer", "name", "dtype", "shape", "offset", "nbytes"}``, with offsets
relative to the start of ``data``.

A file is written to a temporary name beside the target and renamed into place, so a crash
never leaves a half-written file under the target name. Loading checks the magic, the
version, every length and the digest before it builds anything: a truncated, corrupted or
wrong-version file raises :class:`CacheFileError` and never returns a wrong cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import Any

import numpy as np

from . import _compat

__all__ = ["save_cache", "load_cache", "CacheFileError", "FORMAT_VERSION"]

MAGIC = b"ARRAYKV\x00"
FORMAT_VERSION = 1
_DIGEST = 32


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: truncated, corrupted, wrong version or not a cache."""


def save_cache(cache: Any, path: str | os.PathLike) -> int:
    """Write ``cache`` to ``path``; return the file's size in bytes.

    Parameters
    ----------
    cache : LayeredCache
        Any cache built on :class:`arraykv.caches.LayeredCache` (every built-in method).
    path : str or path-like
        Target file; replaced atomically.

    Notes
    -----
    Every layer's lock is held while the state is copied to the host, so the file is one
    consistent snapshot even while other threads decode.
    """
    from .caches.base import LayeredCache

    if not isinstance(cache, LayeredCache):
        raise TypeError(f"cache must be a LayeredCache (any built-in method), received {type(cache).__name__}")
    config = cache.get_config()
    layers, arrays, blobs = [], [], []
    offset = 0
    with cache._all_layers_locked():
        for i, st in enumerate(cache._states):
            if st is None:
                layers.append(None)
                continue
            held = cache._layer_arrays(st)
            layers.append({"length": st.length, "batch": st.batch, "dtype": _dtype_name(st.dtype),
                           "arrays": list(held)})
            for name, a in held.items():
                host = np.ascontiguousarray(_compat.to_numpy(a))
                blob = host.tobytes()
                arrays.append({"layer": i, "name": name, "dtype": host.dtype.str, "shape": list(host.shape),
                               "offset": offset, "nbytes": len(blob)})
                blobs.append(blob)
                offset += len(blob)
    header = json.dumps({"config": config, "layers": layers, "arrays": arrays}, sort_keys=True).encode("utf-8")
    digest = hashlib.sha256()
    head = MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header
    digest.update(head)
    for blob in blobs:
        digest.update(blob)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".arraykv-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            for blob in blobs:
                f.write(blob)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(head) + offset + _DIGEST


def load_cache(path: str | os.PathLike, *, xp: Any = None):
    """Read a cache written by :func:`save_cache`.

    Parameters
    ----------
    path : str or path-like
    xp : namespace, optional
        Array namespace for the loaded state (for example ``cupy`` to move a cache to the GPU).
        Default: NumPy.

    Returns
    -------
    LayeredCache
        A cache of the saved method and options whose state is bit-identical to the saved one.

    Raises
    ------
    CacheFileError
        Truncated or corrupted file, unknown version, or content that does not fit the method.
    FileNotFoundError
        No file at ``path``.
    """
    from .caches.registry import make_cache

    with open(os.fspath(path), "rb") as f:
        data = f.read()
    if len(data) < len(MAGIC) + 12 + _DIGEST or data[: len(MAGIC)] != MAGIC:
        raise CacheFileError(f"{path} is not an arraykv cache file (bad magic or too short)")
    version, hlen = struct.unpack_from("<IQ", data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise CacheFileError(f"{path} has format version {version}; this arraykv reads version {FORMAT_VERSION}")
    start = len(MAGIC) + 12
    if start + hlen + _DIGEST > len(data):
        raise CacheFileError(f"{path} is truncated (header runs past the end of the file)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise CacheFileError(f"{path} is corrupted or truncated (checksum mismatch)")
    try:
        header = json.loads(body[start : start + hlen].decode("utf-8"))
        config, layers, arrays = header["config"], header["layers"], header["arrays"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheFileError(f"{path} has an unreadable header: {exc}") from None
    if xp is None:
        import array_api_compat.numpy as xp  # noqa: N813 - the default namespace
    payload = memoryview(body)[start + hlen :]
    try:
        cache = make_cache(**config)
        if len(layers) != cache.num_layers:
            raise CacheFileError(f"{path} holds {len(layers)} layers but its config says {cache.num_layers}")
        by_layer: dict[int, dict] = {}
        for a in arrays:
            off, n = int(a["offset"]), int(a["nbytes"])
            if off < 0 or off + n > len(payload):
                raise CacheFileError(f"{path}: array {a['name']!r} lies outside the data section")
            host = np.frombuffer(payload[off : off + n], dtype=np.dtype(a["dtype"])).reshape(a["shape"])
            by_layer.setdefault(int(a["layer"]), {})[a["name"]] = xp.asarray(host.copy())
        states = []
        for i, meta in enumerate(layers):
            if meta is None:
                states.append(None)
                continue
            held = by_layer.get(i, {})
            if sorted(held) != sorted(meta["arrays"]):
                raise CacheFileError(f"{path}: layer {i} lists arrays {meta['arrays']} but holds {sorted(held)}")
            dtype = getattr(xp, meta["dtype"])
            first = next(iter(held.values()), None)
            dev = _compat.device(first) if first is not None else None
            states.append(cache._restore_layer(xp, dev, int(meta["batch"]), dtype, int(meta["length"]), held))
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CacheFileError(f"{path} does not describe a valid {config.get('method', '?')!r} cache: {exc}") from None
    cache._states = states
    return cache


def _dtype_name(dtype: Any) -> str:
    from ._validation import dtype_name

    return dtype_name(dtype)
