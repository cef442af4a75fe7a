"""A disk cache of a GGUF model's dequantized float32 weights, memory-mapped on later loads.

Dequantizing a GGUF file and parsing its metadata takes tens of seconds on a busy machine (22 s
for SmolLM2-135M); reading the float32 weights back from one file takes a second. The first
:func:`~arraykv.integrations.decoder.gguf_loading.load_model` of a file writes its laid-out weights, its
config and its tokenizer here; later loads map the file read-only instead of reading the GGUF.

The file
    ``<dir>/<sha256 of the GGUF path>.akw``: the magic ``b"ARRAYKVW"``, the header's length
    (little-endian uint64) and CRC-32 (uint32), the header (UTF-8 JSON: the GGUF file's
    identity, free-form metadata, and each array's name, dtype, shape, offset and CRC-32), then
    the arrays, each aligned to 64 bytes.
Identity
    The GGUF file's resolved path, size and ``mtime_ns``, and the version of whatever produced
    the arrays (``version``, given by the caller). Any difference makes the cached file stale:
    it is ignored and written anew.
Damage
    A short file, a header whose CRC-32 differs, or an array whose CRC-32 differs is never
    used: :func:`read` returns None and the caller rebuilds the file.
Atomic writes
    A file is written under a temporary name beside its final one and renamed over it, so a
    reader sees the old file or the new one, never a part; two processes writing at once each
    rename a whole file. Writing is best effort: a directory that cannot be written leaves the
    cache off, silently.
Where
    :func:`cache_location`: ``$ARRAYKV_WEIGHT_CACHE`` when set to a directory, off when set to
    ``0``, ``off``, ``false`` or ``no``, else ``weights/`` under the arraykv cache directory
    (``$ARRAYKV_CACHE_DIR`` or ``~/.cache/arraykv``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "cache_location", "cache_file", "identity", "read", "write", "prune"]

#: Version of the file layout itself.
FORMAT = 1
_MAGIC = b"ARRAYKVW"
_PREFIX = struct.Struct("<8sQI")
_ALIGN = 64
_OFF = ("0", "off", "false", "no")
_ENV = "ARRAYKV_WEIGHT_CACHE"


def cache_location() -> Path | None:
    """The weight cache directory (not created), or None when ``$ARRAYKV_WEIGHT_CACHE`` turns it off."""
    env = os.environ.get(_ENV)
    if env is not None and env.strip().lower() in _OFF:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("ARRAYKV_CACHE_DIR")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "arraykv") / "weights"


def cache_file(directory: Path, source: Path) -> Path:
    """Where the cached weights of GGUF file ``source`` live in ``directory``."""
    name = hashlib.sha256(str(Path(source).resolve()).encode()).hexdigest()[:32]
    return Path(directory) / f"{name}.akw"


def identity(source: Path, version: str) -> dict:
    """The identity of GGUF file ``source`` as loaded by a loader of ``version``.

    Parameters
    ----------
    source : Path
    version : str
        The loader's version: a change of the code that produced the arrays (dequantization,
        layout) must change it.

    Returns
    -------
    dict
        ``path`` (resolved), ``size``, ``mtime_ns``, ``version`` and the file layout's
        :data:`FORMAT`.
    """
    p = Path(source).resolve()
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": version, "format": FORMAT}


def _pad(n: int) -> int:
    return -n % _ALIGN


def write(path: Path, ident: dict, meta: dict, arrays: Mapping[str, np.ndarray]) -> bool:
    """Write ``arrays`` with ``ident`` and ``meta`` to ``path`` atomically; False when it cannot.

    Parameters
    ----------
    path : Path
        The cache file (:func:`cache_file`); its directory is created.
    ident : dict
        :func:`identity` of the source, checked by :func:`read`.
    meta : dict
        JSON-serializable data kept with the arrays (config, tokenizer, ...).
    arrays : mapping of str to numpy.ndarray
        Any dtype without objects, any shape; written C-contiguous.

    Returns
    -------
    bool
        Whether the file was written (an unwritable directory or a full disk give False and
        leave no partial file).
    """
    entries, offset = [], 0
    host = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.hasobject:
            raise TypeError(f"array {name!r} holds Python objects; only plain dtypes are cached")
        host[name] = a
        crc = zlib.crc32(a.data.cast("B")) if a.size else 0
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "crc": crc})
        offset += a.nbytes + _pad(a.nbytes)
    header = json.dumps({"identity": ident, "meta": meta, "arrays": entries, "data_bytes": offset}).encode()
    start = _PREFIX.size + len(header)
    start += _pad(start)
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(_MAGIC, len(header), zlib.crc32(header)))
            f.write(header)
            f.write(b"\0" * (start - _PREFIX.size - len(header)))
            for a in host.values():
                f.write(a.data.cast("B") if a.size else b"")
                f.write(b"\0" * _pad(a.nbytes))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _header(path: Path) -> tuple | None:
    """``(header dict, data start)`` of a cache file, or None when it is absent or damaged."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) != _PREFIX.size:
                return None
            magic, n, crc = _PREFIX.unpack(prefix)
            if magic != _MAGIC or n > (1 << 30):
                return None
            raw = f.read(n)
    except OSError:
        return None
    if len(raw) != n or zlib.crc32(raw) != crc:
        return None
    try:
        head = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(head, dict):
        return None
    start = _PREFIX.size + n
    return head, start + _pad(start)


def read(path: Path, ident: dict, on_meta: Callable[[dict], None] | None = None) -> tuple | None:
    """The cached ``(meta, arrays)`` of ``path`` when its identity is ``ident`` and it is whole; else None.

    Parameters
    ----------
    path : Path
    ident : dict
        :func:`identity` of the source now.
    on_meta : callable, optional
        Called with the metadata as soon as the header is read and matches ``ident``, before
        the arrays are checked (the longer part); the arrays may still turn out damaged.

    Returns
    -------
    tuple of (dict, dict of str to numpy.ndarray) or None
        The arrays are read-only views of one memory map of the file. None for a missing,
        stale (another identity), short or damaged (a CRC-32 that differs) file.
    """
    found = _header(path)
    if found is None:
        return None
    head, start = found
    if head.get("identity") != ident:
        return None
    if on_meta is not None:
        on_meta(head.get("meta", {}))
    try:
        size = Path(path).stat().st_size
        if size != start + int(head["data_bytes"]):
            return None
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else None
        arrays = {}
        for e in head["arrays"]:
            dt, shape = np.dtype(e["dtype"]), tuple(int(s) for s in e["shape"])
            nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
            lo = start + int(e["offset"])
            raw = mm[lo : lo + nbytes] if nbytes and mm is not None else np.zeros(0, np.uint8)
            if len(raw) != nbytes or (zlib.crc32(raw.data.cast("B")) if nbytes else 0) != e["crc"]:
                return None
            a = np.asarray(raw).view(dt).reshape(shape)
            arrays[str(e["name"])] = a
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return head.get("meta", {}), arrays


def prune(directory: Path, keep: Path) -> None:
    """Delete cache files in ``directory`` (other than ``keep``) whose GGUF file no longer exists."""
    try:
        files = list(Path(directory).glob("*.akw"))
    except OSError:
        return
    for f in files:
        if f == keep:
            continue
        found = _header(f)
        src = found[0].get("identity", {}).get("path") if found is not None else None
        if found is None or not isinstance(src, str) or not os.path.exists(src):
            with contextlib.suppress(OSError):
                f.unlink()
