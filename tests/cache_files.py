"""Cache files as editable structures: read one, change its header or arrays, write it back well-formed.

A structure is ``{"config": dict, "layers": [dict or None], "arrays": [[layer, name, ndarray], ...]}``
(the header of :mod:`arraykv.storage.cache_file` with the arrays in place of their entries).
:func:`serialize_file` recomputes every offset, byte count and the SHA-256 trailer, so an
edited structure is a file that passes every check of the format and tests what the loader
does with its content.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from arraykv.storage.cache_file import MAGIC

_PREFIX = len(MAGIC) + 12


def parse_file(data: bytes) -> dict:
    """The structure of the bytes of a cache file."""
    hlen = struct.unpack_from("<IQ", data, len(MAGIC))[1]
    header = json.loads(data[_PREFIX : _PREFIX + hlen])
    payload = data[_PREFIX + hlen : -32]
    arrays = []
    for e in header["arrays"]:
        a = np.frombuffer(payload[e["offset"] : e["offset"] + e["nbytes"]], dtype=np.dtype(e["dtype"]))
        arrays.append([e["layer"], e["name"], a.reshape(e["shape"]).copy()])
    return {"config": header["config"], "layers": header["layers"], "arrays": arrays}


def serialize_file(f: dict) -> bytes:
    """The bytes of structure ``f``: offsets and byte counts as its arrays have them, a fresh SHA-256."""
    entries, blobs, offset = [], [], 0
    for layer, name, a in f["arrays"]:
        blob = np.ascontiguousarray(a).tobytes()
        entries.append(
            {
                "layer": layer,
                "name": name,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": len(blob),
            }
        )
        blobs.append(blob)
        offset += len(blob)
    header = json.dumps({"config": f["config"], "layers": f["layers"], "arrays": entries}).encode()
    body = MAGIC + struct.pack("<IQ", 1, len(header)) + header + b"".join(blobs)
    return body + hashlib.sha256(body).digest()


def edit_file(path, edit) -> None:
    """Apply ``edit(structure)`` (in place) to the cache file at ``path`` and write it back."""
    with open(path, "rb") as fh:
        f = parse_file(fh.read())
    edit(f)
    with open(path, "wb") as fh:
        fh.write(serialize_file(f))


def array_of(f: dict, layer: int, name: str) -> np.ndarray:
    """The array ``name`` of ``layer`` in structure ``f`` (to edit in place, or to replace via :func:`set_array`)."""
    return next(a for i, n, a in f["arrays"] if i == layer and n == name)


def set_array(f: dict, layer: int, name: str, value: np.ndarray) -> None:
    """Replace the array ``name`` of ``layer`` in structure ``f``."""
    for e in f["arrays"]:
        if e[0] == layer and e[1] == name:
            e[2] = value
            return
    raise KeyError(name)
