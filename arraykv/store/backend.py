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
- ``get`` does not count as a use: ``touch`` does, and a reader calls it only once the entry
  it read was accepted, so a damaged entry is not kept over good ones;
- ``evict`` keeps the total under a byte budget, least recently used first;
- every failure of the medium (a server gone, answering garbage or too slowly; a disk full; a
  file that is not a regular file) is a :class:`StoreError`, never another exception or a hang.

:class:`GuardedBackend` holds the last promise for any backend: it turns whatever else a backend
raises into a :class:`StoreError` and, after a failure, skips the backend for a back-off period
(a circuit breaker), so a server that is down costs one timeout per period, not one per call.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, overload, runtime_checkable

__all__ = [
    "StoreBackend",
    "GuardedBackend",
    "guarded",
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
_T = TypeVar("_T")


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

    def get(self, key: str) -> bytes | bytearray | None:
        """The entry's bytes, or None when there is none (or it expired).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bytes, bytearray or None
            The bytes ``put`` stored, whole; None for a miss. Reading is not a use: the entry's
            use time moves only with :meth:`touch`.

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

    def touch(self, key: str) -> bool:
        """Mark the entry as used now (what eviction orders by); whether there was one.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when an entry was held and marked.
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


#: First back-off of :class:`GuardedBackend` after a failure, and its cap (seconds).
DEFAULT_BACKOFF = (1.0, 60.0)


class GuardedBackend:
    """A backend whose every failure is a :class:`StoreError`, skipped for a while after one.

    The circuit breaker: a call that fails with anything but an :class:`EntryError` (an entry
    refused, which says nothing of the backend's health) opens the circuit for ``backoff``
    seconds, during which every call fails at once with a :class:`StoreError` naming the
    failure; the first call after that is a probe: its success closes the circuit, its failure
    opens it again for twice as long, up to ``max_backoff``. A server that stopped answering
    thus costs one timeout per back-off period instead of one per lookup and write.

    Parameters
    ----------
    backend : StoreBackend
        The backend guarded.
    backoff : float, default 1.0
        Seconds the backend is skipped after a first failure.
    max_backoff : float, default 60.0
        The longest period (it doubles with each failed probe).
    clock : callable, default time.monotonic
        Seconds, for the periods.

    Attributes
    ----------
    backend : StoreBackend
        The backend guarded; its other attributes are read through this object.
    failures : int
        Consecutive failures (0 while the backend works).
    """

    def __init__(
        self,
        backend: Any,
        *,
        backoff: float = DEFAULT_BACKOFF[0],
        max_backoff: float = DEFAULT_BACKOFF[1],
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(backend, GuardedBackend):
            raise TypeError("backend is guarded already; pass its .backend")
        self.backoff = float(check_limit("backoff", backoff, allow_none=False))
        self.max_backoff = float(check_limit("max_backoff", max_backoff, allow_none=False))
        if self.max_backoff < self.backoff:
            raise ValueError(f"max_backoff must be at least backoff={self.backoff}, received {max_backoff!r}")
        self.backend = backend
        self.failures = 0
        self._clock = clock
        self._until = 0.0
        self._last = ""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GuardedBackend({self.backend!r})"

    def __getattr__(self, name: str) -> Any:
        if name == "backend":  # not set yet (during unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.backend, name)

    @property
    def open_for(self) -> float:
        """Seconds the backend will still be skipped (0.0 when calls go through)."""
        return max(0.0, self._until - self._clock())

    def reset(self) -> None:
        """Close the circuit now: the next call goes to the backend."""
        with self._lock:
            self.failures, self._until = 0, 0.0

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        with self._lock:
            now = self._clock()
            if now < self._until:
                raise StoreError(
                    f"the store is skipped for {self._until - now:.1f} s more after a failure ({self._last})"
                )
            if self.failures:  # a probe: others keep skipping while it runs
                self._until = now + self._period()
        try:
            out = fn()
        except EntryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a backend raises is a failure of the store
            err = exc if isinstance(exc, StoreError) else StoreError(_describe(what, exc))
            with self._lock:
                self.failures += 1
                self._until = self._clock() + self._period()
                self._last = str(err)[:300]
            if err is exc:
                raise
            raise err from exc
        if self.failures:
            with self._lock:
                self.failures, self._until = 0, 0.0
        return out

    def _period(self) -> float:
        return min(self.max_backoff, self.backoff * 2.0 ** max(0, min(self.failures - 1, 60)))

    # -- the interface --------------------------------------------------------------
    def get(self, key: str) -> bytes | bytearray | None:
        """:meth:`StoreBackend.get` of the backend, guarded.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bytes, bytearray or None
            The entry's bytes, or None for a miss.
        """
        check_key(key)
        data = self._call("read an entry", lambda: self.backend.get(key))
        if data is not None and not isinstance(data, (bytes, bytearray)):
            raise StoreError(f"the store's get returned {type(data).__name__}, not bytes")
        return data

    def put(self, key: str, data: bytes, *, tokens: int | None = None) -> None:
        """:meth:`StoreBackend.put` of the backend, guarded.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.
        data : bytes
            The entry (bytes-like).
        tokens : int, optional
            Prefix tokens the entry holds.
        """
        check_key(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, received {type(data).__name__}")
        self._call("store an entry", lambda: self.backend.put(key, data, tokens=tokens))

    def touch(self, key: str) -> bool:
        """:meth:`StoreBackend.touch` of the backend, guarded (False for a backend without one).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when an entry was marked.
        """
        check_key(key)
        touch = getattr(self.backend, "touch", None)
        if not callable(touch):
            return False
        return bool(self._call("mark an entry as used", lambda: touch(key)))

    def contains(self, key: str) -> bool:
        """:meth:`StoreBackend.contains` of the backend, guarded.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when an unexpired entry is held.
        """
        check_key(key)
        return bool(self._call("look an entry up", lambda: self.backend.contains(key)))

    def delete(self, key: str) -> bool:
        """:meth:`StoreBackend.delete` of the backend, guarded.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when an entry was removed.
        """
        check_key(key)
        return bool(self._call("delete an entry", lambda: self.backend.delete(key)))

    def entries(self) -> list:
        """:meth:`StoreBackend.entries` of the backend, guarded.

        Returns
        -------
        list of EntryInfo
            One per entry.
        """
        return list(self._call("list entries", self.backend.entries))

    def evict(self, max_bytes: int | None = None) -> list:
        """:meth:`StoreBackend.evict` of the backend, guarded.

        Parameters
        ----------
        max_bytes : int, optional
            The budget; default the backend's own.

        Returns
        -------
        list of str
            Keys of the entries removed.
        """
        check_limit("max_bytes", max_bytes)
        return list(self._call("evict entries", lambda: self.backend.evict(max_bytes)))


def guarded(backend: Any) -> GuardedBackend:
    """``backend`` behind a :class:`GuardedBackend` (itself when it is one already).

    Parameters
    ----------
    backend : StoreBackend
        Any backend.

    Returns
    -------
    GuardedBackend
        The guard, with the default back-off.
    """
    return backend if isinstance(backend, GuardedBackend) else GuardedBackend(backend)


def _describe(what: str, exc: BaseException) -> str:
    """A failure's message: what was tried, the exception's type and text (bounded)."""
    text = str(exc)
    try:
        text = text[:300]
    except Exception:  # noqa: BLE001 - a garbage message
        text = "?"
    return f"the store could not {what}: {type(exc).__name__}: {text}"
