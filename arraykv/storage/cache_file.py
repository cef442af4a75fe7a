"""The cache file format: writing a snapshot of a cache's layers, reading and checking one.

File format (version 1)
-----------------------
::

    magic    8 bytes   b"ARRAYKV\\x00"
    version  4 bytes   little-endian uint32 (1)
    hlen     8 bytes   little-endian uint64, length of the header
    header   hlen      UTF-8 JSON: {"config": {...}, "layers": [...], "arrays": [...]}
    data               the arrays' bytes, C order, at the offsets the header gives
    digest   32 bytes  SHA-256 of everything before it

``config`` is the cache's ``get_config()`` (method name and options, so the loader rebuilds
the same codec: same seed, same rotation). ``layers`` holds, per layer, ``null`` for an empty
layer or ``{"length", "batch", "dtype", "arrays": [names]}``. Each entry of ``arrays`` is
``{"layer", "name", "dtype", "shape", "offset", "nbytes"}``, with offsets relative to the
start of ``data``.

A file is written to a temporary name beside the target and renamed into place, so a crash
never leaves a half-written file under the target name. The same bytes are built in memory by
:func:`encode_cache_file` (one buffer of the file's size, nothing written anywhere) and read
back by :func:`parse_cache_file` from any bytes-like object without copying it (each array is
copied out once). :func:`read_cache_file` checks the
magic, the version, the digest and every field of the header against the data (types,
ranges, dtypes, shapes against byte counts, offsets inside the data, one entry per listed
array) before it returns anything, and raises :class:`CacheFileError` for every defect: a
file cannot make the reader allocate more than the file holds.

The digest is a checksum, not a signature: anyone who edits a file can recompute it. So the
reader also bounds the geometry the configuration declares before any cache is built from
it, since a cache allocates fixed state by it (rotations of ``head_dim²``, codebooks, the
``max_tokens`` rows its buffers reserve at once): ``num_kv_heads`` at most
:data:`MAX_KV_HEADS`, ``head_dim`` at most :data:`MAX_HEAD_DIM`, ``num_layers`` at most
:data:`MAX_LAYERS`, layer lengths and ``max_tokens`` at most :data:`MAX_TOKENS`, a layer's
``batch × num_kv_heads × head_dim`` at most :data:`MAX_ROW_VALUES` or eight values per byte
of the file (a layer holding tokens holds at least a quarter of a byte per value of each;
this bounds what a layer without tokens, or the next token of an empty one, allocates), and
the rows ``max_tokens`` reserves, ``max_tokens × batch × num_kv_heads × head_dim × 4`` bytes
per layer (batch 1 for an empty one), at most :data:`MAX_RESERVED_BYTES`. What the layers'
arrays must hold is then checked against the cache that the configuration builds
(:mod:`arraykv.caches.layout`), before a layer is built (:func:`arraykv.load`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._types import Array

__all__ = [
    "CacheFileError",
    "LayerRecord",
    "write_cache_file",
    "read_cache_file",
    "encode_cache_file",
    "parse_cache_file",
    "FORMAT_VERSION",
    "LAYER_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_KV_HEADS",
    "MAX_LAYERS",
    "MAX_TOKENS",
    "MAX_ROW_VALUES",
    "MAX_RESERVED_BYTES",
]

MAGIC = b"ARRAYKV\x00"
FORMAT_VERSION = 1
_DIGEST = 32
_PREFIX = len(MAGIC) + 12
#: dtypes a layer's callers may use (the ``dtype`` of a layer entry).
LAYER_DTYPES = ("float16", "float32", "float64", "bfloat16")
#: kinds of the stored arrays: unsigned/signed integers, floats and booleans (never objects).
_ARRAY_KINDS = "uifb"
#: Largest ``head_dim`` a file may declare (models use 64 to 256; a ``tq`` cache holds a
#: ``head_dim²`` sketch, 64 MiB at this bound).
MAX_HEAD_DIM = 4096
#: Largest ``num_kv_heads`` a file may declare.
MAX_KV_HEADS = 1024
#: Largest ``num_layers`` a file may declare.
MAX_LAYERS = 4096
#: Largest layer length (a position) and ``max_tokens`` a file may declare.
MAX_TOKENS = 1 << 31
#: Values of one token row of a layer (``batch × num_kv_heads × head_dim``) a file may declare
#: without holding them (the bound is eight times the file's bytes where that is larger).
MAX_ROW_VALUES = 1 << 24
#: Bytes the rows reserved for ``max_tokens`` tokens of one layer may take (4 GiB).
MAX_RESERVED_BYTES = 1 << 32


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: truncated, corrupted, wrong version or not a cache."""


@dataclass(frozen=True)
class LayerRecord:
    """One non-empty layer of a cache file.

    Attributes
    ----------
    length : int
        Tokens the layer holds.
    batch : int
        Its batch size.
    dtype : str
        The callers' dtype, one of :data:`LAYER_DTYPES`.
    arrays : dict of str to numpy.ndarray
        The layer's arrays by name (host copies when read; any host arrays when written).
    """

    length: int
    batch: int
    dtype: str
    arrays: dict


def _layout(config: dict, layers: list) -> tuple[bytes, list]:
    """``(head, hosts)``: the file's magic, version, length and header, and the arrays in file order."""
    records: list[dict[str, Any] | None] = []
    arrays, hosts = [], []
    offset = 0
    for i, rec in enumerate(layers):
        if rec is None:
            records.append(None)
            continue
        records.append(
            {"length": int(rec.length), "batch": int(rec.batch), "dtype": rec.dtype, "arrays": list(rec.arrays)}
        )
        for name, a in rec.arrays.items():
            host = np.ascontiguousarray(a)
            arrays.append(
                {
                    "layer": i,
                    "name": name,
                    "dtype": host.dtype.str,
                    "shape": list(host.shape),
                    "offset": offset,
                    "nbytes": int(host.nbytes),
                }
            )
            hosts.append(host)
            offset += int(host.nbytes)
    header = json.dumps({"config": config, "layers": records, "arrays": arrays}, sort_keys=True).encode("utf-8")
    return MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header, hosts


def encode_cache_file(config: dict, layers: list) -> bytearray:
    """The bytes of the cache file of ``config`` and ``layers``, built in one buffer in memory.

    Parameters
    ----------
    config : dict
        The cache's ``get_config()`` (JSON-serializable).
    layers : list of LayerRecord or None
        One per layer; the records' arrays are host (NumPy) arrays.

    Returns
    -------
    bytearray
        Exactly what :func:`write_cache_file` writes: header, arrays and digest, in one buffer
        of the file's size (no other copy of the arrays is made).
    """
    head, hosts = _layout(config, layers)
    size = len(head) + sum(int(h.nbytes) for h in hosts) + _DIGEST
    out = bytearray(size)
    dst = np.frombuffer(out, dtype=np.uint8)
    dst[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    off = len(head)
    for h in hosts:
        n = int(h.nbytes)
        if n:
            dst[off : off + n] = h.reshape(-1).view(np.uint8)
        off += n
    del dst
    view = memoryview(out)
    view[off:] = hashlib.sha256(view[:off]).digest()
    del view
    return out


def write_cache_file(path: str | os.PathLike, config: dict, layers: list) -> int:
    """Write ``config`` and ``layers`` (``LayerRecord`` or None each) to ``path``; return its size.

    The arrays of the records must be host (NumPy) arrays; ``path`` is replaced atomically.
    """
    data = encode_cache_file(config, layers)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".arraykv-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(data)


def _int(where: str, value: Array, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise CacheFileError(f"{where} must be an integer {span}, found {value!r}")
    return value


def _array_dtype(where: str, name: Any) -> np.dtype:
    try:
        dt = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in _ARRAY_KINDS or dt.hasobject:
        raise CacheFileError(f"{where} has dtype {name!r}; arrays hold integers, floats or booleans")
    return dt


def read_cache_file(path: str | os.PathLike) -> tuple[dict[str, Any], list[LayerRecord | None]]:
    """Read and check a cache file: ``(config, layers)`` with ``layers`` a list of LayerRecord or None.

    Raises
    ------
    CacheFileError
        Anything wrong with the file: every check is done before an array is built.
    FileNotFoundError, IsADirectoryError, PermissionError
        From opening ``path``.
    """
    with open(os.fspath(path), "rb") as f:
        data = f.read()
    return parse_cache_file(data, path)


def parse_cache_file(
    data: Any, path: str | os.PathLike = "the data", *, copy: bool = True
) -> tuple[dict[str, Any], list[LayerRecord | None]]:
    """Check the bytes of a cache file and read them: what :func:`read_cache_file` does, from memory.

    Parameters
    ----------
    data : bytes-like
        The whole file; read in place (not copied).
    path : str or path-like, default "the data"
        How errors name the bytes.
    copy : bool, default True
        Copy each array out of ``data``; False returns read-only views of it instead (no
        memory beyond ``data``: for a reader that copies them itself, as a cache's ``restore``
        does).

    Returns
    -------
    config : dict
        The cache's configuration.
    layers : list of LayerRecord or None
        One per layer; their arrays are copies (nothing refers to ``data`` after the call), or
        with ``copy=False`` read-only views of ``data``.

    Raises
    ------
    CacheFileError
        Anything wrong with the bytes: every check is done before an array is built.
    """
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX + _DIGEST or bytes(data[: len(MAGIC)]) != MAGIC:
        raise CacheFileError(f"{path} is not an arraykv cache file (bad magic or too short)")
    version, hlen = struct.unpack_from("<IQ", data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise CacheFileError(f"{path} has format version {version}; this arraykv reads version {FORMAT_VERSION}")
    if _PREFIX + hlen + _DIGEST > len(data):
        raise CacheFileError(f"{path} is truncated (header runs past the end of the file)")
    body, digest = data[:-_DIGEST], bytes(data[-_DIGEST:])
    if hashlib.sha256(body).digest() != digest:
        raise CacheFileError(f"{path} is corrupted or truncated (checksum mismatch)")
    try:
        header = json.loads(bytes(body[_PREFIX : _PREFIX + hlen]).decode("utf-8"))
        config, layers, entries = header["config"], header["layers"], header["arrays"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CacheFileError(f"{path} has an unreadable header: {exc}") from None
    if not isinstance(config, dict) or not isinstance(layers, list) or not isinstance(entries, list):
        raise CacheFileError(f"{path}: header fields config/layers/arrays must be an object and two lists")
    if config.get("num_layers") != len(layers):
        raise CacheFileError(f"{path} holds {len(layers)} layers but its config says {config.get('num_layers')!r}")
    payload = body[_PREFIX + hlen :]
    by_layer: dict = {}
    for j, a in enumerate(entries):
        where = f"{path}: array entry {j}"
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not isinstance(a.get("shape"), list):
            raise CacheFileError(f"{where} is malformed: {a!r}"[:300])
        layer = _int(f"{where} layer", a.get("layer"), 0, max(len(layers) - 1, 0))
        dt = _array_dtype(where, a.get("dtype"))
        shape = tuple(_int(f"{where} shape", s, 0, len(payload)) for s in a["shape"])
        off = _int(f"{where} offset", a.get("offset"), 0, len(payload))
        n = _int(f"{where} nbytes", a.get("nbytes"), 0, len(payload) - off)
        if math.prod(shape) * dt.itemsize != n:
            raise CacheFileError(f"{where} ({a['name']!r}): shape {shape} of {dt} is not {n} bytes")
        arrays = by_layer.setdefault(layer, {})
        if a["name"] in arrays:
            raise CacheFileError(f"{where}: layer {layer} lists array {a['name']!r} twice")
        arr = np.frombuffer(payload[off : off + n], dtype=dt).reshape(shape)
        if copy:
            arr = arr.copy()
        else:
            arr.flags.writeable = False  # a view of the caller's bytes: never written through
        arrays[a["name"]] = arr
    out: list[LayerRecord | None] = []
    for i, meta in enumerate(layers):
        held = by_layer.get(i, {})
        if meta is None:
            if held:
                raise CacheFileError(f"{path}: layer {i} is empty but the file holds arrays for it")
            out.append(None)
            continue
        if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), list):
            raise CacheFileError(f"{path}: layer {i} entry is malformed")
        if sorted(held) != sorted(meta["arrays"]):
            raise CacheFileError(f"{path}: layer {i} lists arrays {meta['arrays']} but holds {sorted(held)}")
        if meta.get("dtype") not in LAYER_DTYPES:
            raise CacheFileError(f"{path}: layer {i} has dtype {meta.get('dtype')!r}; expected one of {LAYER_DTYPES}")
        out.append(
            LayerRecord(
                length=_int(f"{path}: layer {i} length", meta.get("length"), 1, MAX_TOKENS),
                batch=_int(f"{path}: layer {i} batch", meta.get("batch"), 1),
                dtype=meta["dtype"],
                arrays=held,
            )
        )
    _check_geometry(path, config, out, len(payload))
    return config, out


def _check_geometry(path: str | os.PathLike, config: dict, layers: list, nbytes: int) -> None:
    """Bound the geometry ``config`` declares before anything is built from it (module docstring).

    Only integers above a bound are refused here; values of another type or below 1 are left
    to the cache's constructor, which names what it accepts.
    """

    def bounded(name: str, high: int) -> int | None:
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
        if value > high:
            raise CacheFileError(f"{path}: config {name}={value} is more than {high}")
        return value

    bounded("num_layers", MAX_LAYERS)
    heads, head_dim = bounded("num_kv_heads", MAX_KV_HEADS), bounded("head_dim", MAX_HEAD_DIM)
    cap = bounded("max_tokens", MAX_TOKENS)
    if heads is None or head_dim is None:
        return
    row_limit = max(MAX_ROW_VALUES, 8 * nbytes)
    for i, rec in enumerate(layers):
        batch = 1 if rec is None else rec.batch
        row = batch * heads * head_dim
        if row > row_limit:
            raise CacheFileError(
                f"{path}: layer {i} declares batch {batch} × num_kv_heads {heads} × head_dim "
                f"{head_dim} = {row} values per token, more than {row_limit} (the file's bytes "
                f"hold far fewer)"
            )
        if cap is not None and rec is not None and rec.length > cap:
            raise CacheFileError(f"{path}: layer {i} holds {rec.length} tokens, more than max_tokens={cap}")
        if cap is not None and cap * row * 4 > MAX_RESERVED_BYTES:
            raise CacheFileError(
                f"{path}: max_tokens={cap} would reserve {cap * row * 4} bytes for layer {i} "
                f"(batch {batch}), more than {MAX_RESERVED_BYTES}"
            )
