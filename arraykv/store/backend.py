"""The interface every prefix-store backend offers, and what they share: entry facts and errors.

A backend maps a key (a lower-case hexadecimal string, :func:`check_key`) to bytes: the saved
form of a cache (:mod:`arraykv.store.entry`). It knows nothing of models or caches; the
:class:`~arraykv.store.prefix.PrefixStore` above it derives the keys and reads the bytes.

Every backend promises:

- ``put`` is all or nothing: a reader sees the whole entry or none, even when the writer dies
  part way or the medium fails; two writers of one key leave one of the two entries whole;
- ``get`` never reads more than the entry's declared size, and refuses (:class:`EntryError`)
  an entry whose declared size is over ``max_entry_bytes`` or does not match what is held,
  before reading it;
- expired entries (older than the backend's ``ttl``) are misses;
- ``evict`` keeps the total under a byte budget, least recently used first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol, overload, runtime_checkable

__all__ = [
    "StoreBackend",
    "EntryInfo",
    "StoreError",
    "EntryError",
    "check_key",
    "check_limit",
    "DEFAULT_MAX_ENTRY_BYTES",
]

#: The largest entry a backend reads unless told otherwise (4 GiB: an 8k-token float32 dense
#: cache of a 1B model is about 1 GiB).
DEFAULT_MAX_ENTRY_BYTES = 1 << 32

_KEY = re.compile(r"[0-9a-f]{16,128}")


class StoreError(RuntimeError):
    """A backend could not do what was asked (server unreachable, disk full, ...)."""


class EntryError(ValueError):
    """An entry that is refused: larger than allowed, torn, corrupted, or not the cache it claims to be."""


@dataclass(frozen=True)
class EntryInfo:
    """What a backend knows of one entry.

    Parameters
    ----------
    key : str
        The entry's key (hexadecimal).
    nbytes : int
        Bytes the entry holds.
    tokens : int or None
        Prefix tokens the entry holds (None where the backend cannot tell cheaply).
    created : float
        When it was written, seconds since the epoch.
    last_used : float
        When it was last read or written, seconds since the epoch (what eviction orders by).
    expires : float or None
        When it stops being served (seconds since the epoch), None without a TTL.
    """

    key: str
    nbytes: int
    tokens: int | None
    created: float
    last_used: float
    expires: float | None = None


@runtime_checkable
class StoreBackend(Protocol):
    """Bytes by key, shared between processes (see the module docstring for the promises).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated (``TypeError``): a
        backend satisfies the protocol by defining its methods, not by subclassing or calling it.
    """

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None when there is none (or it expired).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bytes or None
            The bytes ``put`` stored, whole; None for a miss.

        Raises
        ------
        EntryError
            An entry over ``max_entry_bytes`` or not matching its declared size (not read).
        StoreError
            The backend failed.
        """

    def put(self, key: str, data: bytes, *, tokens: int | None = None) -> None:
        """Store ``data`` under ``key`` atomically (replacing an entry of the same key).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.
        data : bytes
            The entry (bytes-like), at most ``max_entry_bytes``.
        tokens : int, optional
            Prefix tokens the entry holds, for :meth:`entries` (a backend may read it from the
            entry instead).
        """

    def contains(self, key: str) -> bool:
        """Whether an unexpired entry is held under ``key``.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when :meth:`get` would find an entry now.
        """

    def delete(self, key: str) -> bool:
        """Remove the entry; whether there was one.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when an entry was removed.
        """

    def entries(self) -> list:
        """Every entry held, as :class:`EntryInfo`, in no particular order.

        Returns
        -------
        list of EntryInfo
            One per entry.
        """

    def evict(self, max_bytes: int | None = None) -> list:
        """Drop expired entries, then least recently used ones until at most ``max_bytes`` are
        held (default: the backend's own budget); the keys dropped.

        Parameters
        ----------
        max_bytes : int, optional
            The budget; default the backend's own (None: no budget, only expiry).

        Returns
        -------
        list of str
            Keys of the entries removed.
        """


def check_key(key: object) -> str:
    """``key`` if it is a hexadecimal string of 16-128 lower-case digits, else a ValueError.

    Keys become file names and server keys: nothing but hex digits gets that far.
    """
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"key must be a string of 16-128 lower-case hexadecimal digits, received {key!r}"[:200])
    return key


@overload
def check_limit(name: str, value: object, *, allow_none: Literal[False]) -> int | float: ...
@overload
def check_limit(name: str, value: object, *, allow_none: bool = True) -> int | float | None: ...
def check_limit(name: str, value: object, *, allow_none: bool = True) -> int | float | None:
    """A positive number (or None where allowed) for a size or time limit, else a ValueError naming it."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise ValueError(f"{name} must be a positive number{' or None' if allow_none else ''}, received {value!r}")
    if value == float("inf"):
        raise ValueError(f"{name} must be finite, received {value!r}")
    return value
