"""An LMCache serializer: LMCache's storage tiers holding arraykv-compressed KV chunks.

LMCache's multiprocess storage (PyPI ``lmcache``, :mod:`lmcache.v1.distributed.serde`) moves KV
chunks of shape ``[2, num_layers, num_tokens, hidden]`` (``KV_2LTD``; ``hidden = kv_heads ×
head_dim``) between tiers through a pluggable serializer. :func:`register` adds one named
``"arraykv"``; an L2 adapter selects it with ``{"serde": {"type": "arraykv", "head_dim": 64,
"method": "pqo4"}}``.

Serialized form of one chunk (what :func:`encode_chunk` returns), padded with zeros to the
buffer LMCache allocates from :func:`serialized_size`::

    magic   8 bytes  b"AKVLMC01"
    length  8 bytes  little-endian uint64: bytes of the cache file that follows
    file    length   a cache file (arraykv.storage.cache_file): the chunk in a cache of
                     ``method``, one layer per model layer, checked on the way back in

:func:`decode_chunk` reads the length, refuses one beyond the buffer, checks the file (format,
configuration equal to the one this serializer builds, every layer holding the chunk's tokens)
and writes the decoded keys and values into the destination layout.

The size LMCache allocates must be an upper bound known from the shape alone, and every byte
of it is stored, so the default options fix every array's size: ``outliers`` a fixed count (2)
rather than ``"auto"``; ``key_scale=False`` since a serializer sees no queries. Pure NumPy
here; the LMCache classes (:func:`serde_classes`) convert torch tensors at the edges.
"""

from __future__ import annotations

import functools
import json
import struct
from typing import Any

import numpy as np

from .._types import Array, DType
from ..caches.registry import make_cache
from .backend import EntryError
from .entry import encode_cache, restore_entry

__all__ = [
    "encode_chunk",
    "decode_chunk",
    "serialized_size",
    "chunk_cache",
    "serde_classes",
    "register",
    "DEFAULT_OPTIONS",
    "MAGIC",
    "SERDE_NAME",
]

MAGIC = b"AKVLMC01"
SERDE_NAME = "arraykv"
#: Options of the default ``pqo4`` chunk cache: sizes fixed by the shape, no query weighting, every
#: token encoded (no exact window, sinks or rollback copies: a chunk is stored, not decoded into).
DEFAULT_OPTIONS = {"outliers": 2, "key_scale": False, "residual_window": 0, "sink_tokens": 0, "rollback_tokens": 0}
_FRAME = len(MAGIC) + 8
#: Bytes added to the measured size as a bound on header differences between chunks (digits).
_MARGIN = 256


def _geometry(shape: tuple, head_dim: int) -> tuple:
    if len(shape) != 4 or int(shape[0]) != 2:
        raise ValueError(f"a KV chunk has shape [2, num_layers, num_tokens, hidden], received {tuple(shape)}")
    _, layers, tokens, hidden = (int(s) for s in shape)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 or hidden % head_dim:
        raise ValueError(f"head_dim must be a positive integer dividing hidden={hidden}, received {head_dim!r}")
    if layers < 1 or tokens < 1:
        raise ValueError(f"a KV chunk needs at least one layer and one token, received {tuple(shape)}")
    return layers, tokens, hidden // head_dim


def chunk_cache(shape: tuple, *, head_dim: int, method: str = "pqo4", options: dict | None = None) -> Any:
    """An empty cache for a chunk of ``shape`` (``[2, L, T, hidden]``)."""
    layers, _, heads = _geometry(shape, head_dim)
    opts = dict(DEFAULT_OPTIONS if options is None else options)
    return make_cache(method, num_layers=layers, num_kv_heads=heads, head_dim=head_dim, **opts)


def encode_chunk(kv: Array, *, head_dim: int, method: str = "pqo4", options: dict | None = None) -> bytes:
    """The serialized form of one KV chunk (module docstring), without padding.

    Parameters
    ----------
    kv : numpy.ndarray, shape (2, num_layers, num_tokens, hidden), float16 or float32
        Keys (``kv[0]``) and values (``kv[1]``); ``hidden = kv_heads × head_dim``.
    head_dim : int
    method : str, default "pqo4"
    options : dict, optional
        Cache options; default :data:`DEFAULT_OPTIONS`.

    Returns
    -------
    bytes
    """
    kv = np.asarray(kv)
    if kv.dtype not in (np.float16, np.float32):
        raise TypeError(f"kv must be float16 or float32, received {kv.dtype}")
    layers, tokens, heads = _geometry(kv.shape, head_dim)
    cache = chunk_cache(kv.shape, head_dim=head_dim, method=method, options=options)
    for layer in range(layers):
        k, v = (
            np.ascontiguousarray(kv[i, layer].reshape(tokens, heads, head_dim).transpose(1, 0, 2))[None] for i in (0, 1)
        )
        cache.append(layer, k, v, k)  # no queries: keys stand in (unused with key_scale=False)
    data = encode_cache(cache)
    return MAGIC + struct.pack("<Q", len(data)) + data


@functools.lru_cache(maxsize=256)
def _measured(shape: tuple, dtype: str, head_dim: int, method: str, options_json: str) -> int:
    probe = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return len(encode_chunk(probe, head_dim=head_dim, method=method, options=json.loads(options_json)))


def serialized_size(
    shape: tuple, dtype: DType, *, head_dim: int, method: str = "pqo4", options: dict | None = None
) -> int:
    """An upper bound of :func:`encode_chunk`'s size for any chunk of ``shape`` and ``dtype``.

    Measured once per shape, dtype and configuration by encoding a random chunk, plus a margin
    for the header's digits. It holds when every array's size follows from the shape, as with
    :data:`DEFAULT_OPTIONS`; :func:`encode_chunk`'s callers check it (``serialize`` raises).
    """
    _geometry(tuple(shape), head_dim)
    opts = DEFAULT_OPTIONS if options is None else options
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ("float16", "float32"):
        name = "float32"  # bfloat16 and others are encoded as float32
    return (
        _measured(tuple(int(s) for s in shape), name, int(head_dim), method, json.dumps(opts, sort_keys=True)) + _MARGIN
    )


def decode_chunk(
    buf: Any, shape: tuple, *, head_dim: int, method: str = "pqo4", options: dict | None = None
) -> np.ndarray:
    """The keys and values of a serialized chunk, shape ``shape`` (``[2, L, T, hidden]``), float32.

    Parameters
    ----------
    buf : bytes-like
        The buffer :func:`encode_chunk` wrote (padding after it is ignored).
    shape : tuple
        What the chunk must hold.

    Raises
    ------
    EntryError
        Bad magic, a length beyond the buffer, an invalid cache file, another configuration, or
        a token count other than the shape's. Nothing larger than ``buf`` is allocated for it.
    """
    view = memoryview(buf).cast("B")
    if len(view) < _FRAME or bytes(view[: len(MAGIC)]) != MAGIC:
        raise EntryError("not an arraykv KV chunk (bad magic or too short)")
    (length,) = struct.unpack("<Q", bytes(view[len(MAGIC) : _FRAME]))
    if length > len(view) - _FRAME:
        raise EntryError(f"the chunk declares {length} bytes but its buffer holds {len(view) - _FRAME}")
    layers, tokens, heads = _geometry(tuple(shape), head_dim)
    cache = chunk_cache(shape, head_dim=head_dim, method=method, options=options)
    restore_entry(cache, bytes(view[_FRAME : _FRAME + length]), tokens=tokens, what="the KV chunk")
    out = np.empty((2, layers, tokens, heads * head_dim), dtype=np.float32)
    for layer in range(layers):
        r = cache.dequantize(layer)
        for i, x in enumerate((r.k, r.v)):
            out[i, layer] = np.asarray(x, dtype=np.float32)[0].transpose(1, 0, 2).reshape(tokens, heads * head_dim)
    return out


def serde_classes() -> tuple[type, type]:
    """``(Serializer, Deserializer)`` subclasses of LMCache's serde interfaces (imports ``lmcache``)."""
    import torch
    from lmcache.v1.distributed.serde.base import Deserializer, Serializer

    def host(t: Array) -> np.ndarray:
        t = t.detach().to("cpu")
        if t.dtype not in (torch.float16, torch.float32):
            t = t.float()
        out: np.ndarray = t.numpy()
        return out

    class ArraykvSerializer(Serializer):
        """Compress each KV chunk into an arraykv cache file (``method`` and ``options``)."""

        def __init__(self, head_dim: int, method: str = "pqo4", options: dict | None = None):
            self.head_dim, self.method, self.options = int(head_dim), method, options

        def serialize(self, src: Any, dst: Any, key: Any) -> int:
            data = encode_chunk(host(src.tensor), head_dim=self.head_dim, method=self.method, options=self.options)
            flat = dst.tensor.reshape(-1)
            if len(data) > flat.numel():
                raise ValueError(f"the chunk takes {len(data)} bytes, more than the {flat.numel()}-byte buffer")
            flat[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            flat[len(data) :].zero_()
            return len(data)

        def estimate_serialized_size(self, layout_desc: Any) -> int:
            total = 0
            for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes):
                name = str(dtype).removeprefix("torch.")
                total += serialized_size(
                    tuple(shape), name, head_dim=self.head_dim, method=self.method, options=self.options
                )
            return total

    class ArraykvDeserializer(Deserializer):
        """Decode a chunk written by :class:`ArraykvSerializer` into the destination layout."""

        def __init__(self, head_dim: int, method: str = "pqo4", options: dict | None = None):
            self.head_dim, self.method, self.options = int(head_dim), method, options

        def deserialize(self, src: Any, dst: Any, key: Any) -> None:
            buf = (
                host(src.tensor.reshape(-1)).tobytes()
                if src.tensor.dtype != torch.uint8
                else src.tensor.reshape(-1).cpu().numpy().tobytes()
            )
            out = decode_chunk(
                buf, tuple(dst.tensor.shape), head_dim=self.head_dim, method=self.method, options=self.options
            )
            dst.tensor.copy_(torch.from_numpy(out).to(dst.tensor.dtype))

    return ArraykvSerializer, ArraykvDeserializer


def register(name: str = SERDE_NAME) -> None:
    """Register the serializer with LMCache's serde factory under ``name`` (once per process).

    An adapter then selects it with ``{"serde": {"type": name, "head_dim": ..., "method": ...,
    "options": {...}, "max_workers": 1}}``.
    """
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

    if name in get_registered_serde_types():
        return
    ser, de = serde_classes()

    def factory(kwargs: dict) -> Any:
        if "head_dim" not in kwargs:
            raise ValueError(f"the {name!r} serde needs head_dim in its config")
        args = {
            "head_dim": int(kwargs["head_dim"]),
            "method": str(kwargs.get("method", "pqo4")),
            "options": kwargs.get("options"),
        }
        return AsyncSerdeProcessor(ser(**args), de(**args), max_workers=int(kwargs.get("max_workers", 1)))

    register_serde_factory(name, factory)
