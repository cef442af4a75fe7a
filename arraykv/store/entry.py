"""A cache as the bytes of a store entry's body, and back: the checked, versioned cache file format.

An entry's body is exactly a cache file (:mod:`arraykv.storage.cache_file`: magic, version,
JSON header with the cache's full configuration, raw arrays, SHA-256 trailer), inside the
envelope that binds it to its key, namespace and token ids (:mod:`arraykv.store.binding`,
checked first). The body is checked by the cache file reader: header against data, geometry
bounded, every array against the layer it claims to be (``restore``), before anything is built.

:func:`restore_entry` puts an entry into an existing, empty cache and also checks that it is
the entry that was asked for: the configuration it carries equals the cache's own, and every
layer holds the expected number of tokens.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

from ..protocol import SNAPSHOTS, supports
from ..storage.cache_file import (
    FORMAT_VERSION,
    MAGIC,
    CacheFileError,
    LayerRecord,
    encode_cache_file,
    parse_cache_file,
)
from .backend import EntryError
from .binding import read_header

__all__ = ["encode_cache", "restore_entry", "peek_entry", "HEADER_LIMIT", "ROLLBACK_ARRAYS"]

#: The longest JSON header :func:`peek_entry` reads (a 64-layer cache's header is about 40 KB).
HEADER_LIMIT = 1 << 24
_PREFIX = len(MAGIC) + 12


#: The arrays of a layer that only serve truncation: copies of its latest encoded tokens.
ROLLBACK_ARRAYS = ("k_rollback", "v_rollback")


def encode_cache(cache: Any, *, rollback_copies: bool = True) -> bytearray:
    """The bytes of ``cache`` saved (what :meth:`~arraykv.caches.LayeredCache.save` writes).

    Parameters
    ----------
    cache : LayeredCache or HybridCache
        Any cache with ``get_config()`` and ``snapshot(host=True)``.
    rollback_copies : bool, default True
        False leaves out the float16 copies of each layer's latest encoded tokens that let
        :meth:`~arraykv.caches.LayeredCache.truncate` go back into them exactly (``k_rollback``
        and ``v_rollback`` are saved with no rows). They take no part in attention: the restored
        cache computes, stores and decodes the same as the original, and holds copies again
        once it has encoded ``rollback_tokens`` tokens of its own; until then it cannot be
        truncated back past the tokens it encoded itself (``min_truncate_length`` says so).
        What a store keeps of a prefix (:class:`~arraykv.store.PrefixStore`).

    Returns
    -------
    bytearray
        The whole cache file: configuration and every layer's arrays, taken to host memory
        and written into one buffer (no file, no second copy).
    """
    if not supports(cache, SNAPSHOTS):
        raise TypeError(
            f"cache must be an arraykv cache (LayeredCache or HybridCache), received {type(cache).__name__}"
        )
    layers = cache.snapshot(host=True)
    if not rollback_copies:
        layers = [None if rec is None else _without_rollback_copies(rec) for rec in layers]
    return encode_cache_file(cache.get_config(), layers)  # in memory: no scratch file, no disk to fill


def _without_rollback_copies(rec: LayerRecord) -> LayerRecord:
    """``rec`` with its rollback copies cut to no rows (axis 2: batch, heads, copies, head_dim)."""
    arrays = {k: (v[:, :, :0, :] if k in ROLLBACK_ARRAYS else v) for k, v in rec.arrays.items()}
    return dataclasses.replace(rec, arrays=arrays)


def _read(data: bytes | bytearray | memoryview, what: str) -> tuple[dict[str, Any], list[LayerRecord | None]]:
    """``(config, layers)`` of entry bytes, or an EntryError saying why not."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"an entry is bytes, received {type(data).__name__}")
    try:
        # read in place: the arrays are read-only views of ``data``, which the cache's restore copies
        return parse_cache_file(data, "the entry", copy=False)
    except CacheFileError as exc:
        raise EntryError(f"{what} is not a valid cache file: {exc}") from None


def restore_entry(
    cache: Any, data: bytes | bytearray | memoryview, *, tokens: int | None = None, what: str = "entry"
) -> None:
    """Put the cache saved in ``data`` into ``cache`` (empty, of the same configuration).

    Parameters
    ----------
    cache : LayeredCache or HybridCache
        The cache to fill; its ``get_config()`` must equal the entry's.
    data : bytes-like
        A cache file (:func:`encode_cache`; a store entry's body).
    tokens : int, optional
        Tokens every layer of the entry must hold.
    what : str
        How errors name the entry.

    Raises
    ------
    EntryError
        The bytes are not a valid cache file, hold another configuration or another number of
        tokens, or arrays the cache cannot hold (``restore``'s checks). ``cache`` is unchanged.
    """
    config, layers = _read(data, what)
    mine = json.loads(json.dumps(cache.get_config()))  # as the file spells it: tuples become lists
    if config != mine:
        diff = sorted(k for k in set(config) | set(mine) if config.get(k) != mine.get(k))
        raise EntryError(f"{what} holds a cache of another configuration (differs in {diff[:8]})")
    lengths = {None if rec is None else rec.length for rec in layers}
    if tokens is not None and lengths != {tokens}:
        raise EntryError(f"{what} should hold {tokens} tokens in every layer, holds {sorted(lengths, key=str)}")
    try:
        cache.restore(layers)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EntryError(f"{what} does not describe a valid {config.get('method')!r} cache: {exc}") from None


def peek_entry(head: bytes) -> dict | None:
    """The method and token count an entry declares, from its first bytes (for listings only).

    Parameters
    ----------
    head : bytes
        The entry's first bytes (its 20-byte prefix and JSON header at least): a store entry
        (:mod:`arraykv.store.binding`) or a bare cache file.

    Returns
    -------
    dict or None
        ``{"method": str, "tokens": int or None}``, or None when ``head`` does not start a
        readable entry or cache file. Nothing here is checked beyond parsing: loading an entry
        goes through :func:`~arraykv.store.binding.open_entry` and :func:`restore_entry`.
    """
    sealed = read_header(head)
    if sealed is not None:
        method, tokens = sealed.get("method"), sealed.get("tokens")
        return {
            "method": method if isinstance(method, str) else None,
            "tokens": tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
        }
    if len(head) < _PREFIX or head[: len(MAGIC)] != MAGIC:
        return None
    version, hlen = struct.unpack_from("<IQ", head, len(MAGIC))
    if version != FORMAT_VERSION or hlen > HEADER_LIMIT or _PREFIX + hlen > len(head):
        return None
    try:
        header = json.loads(head[_PREFIX : _PREFIX + hlen].decode("utf-8"))
        layers = header["layers"]
        lengths = {rec.get("length") for rec in layers if isinstance(rec, dict)}
        method = header["config"].get("method")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    tokens = next(iter(lengths)) if len(lengths) == 1 else None
    return {
        "method": method if isinstance(method, str) else None,
        "tokens": tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
    }
