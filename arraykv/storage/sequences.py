"""The sequence ids of a multi-sequence cache (paged, MLA): handed out once, checked, freed once."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._validation import check_int

__all__ = ["SequenceIds", "check_truncate_length", "fork_store"]


class SequenceIds:
    """Live sequence ids under their own lock; ids are never reused, so a stale id is caught.

    A cache takes this lock after a layer lock, never before (it guards only the id set).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._next = 0

    def allocate(self) -> int:
        """Register a new id and return it."""
        with self._lock:
            sid = self._next
            self._next += 1
            self._live.add(sid)
            return sid

    def live(self) -> list[int]:
        """The live ids, ascending."""
        with self._lock:
            return sorted(self._live)

    def check(self, seq_id: int) -> int:
        """``seq_id`` as an int if it is live, else ``ValueError`` saying why not."""
        sid = check_int("seq_id", seq_id, low=0)
        with self._lock:
            if sid not in self._live:
                state = "was freed" if sid < self._next else "was never allocated"
                raise ValueError(f"seq_id {sid} {state}; allocate_sequence() gives a valid id")
        return sid

    def copy(self) -> SequenceIds:
        """An independent copy: the same live ids, the same next id."""
        twin = SequenceIds()
        with self._lock:
            twin._live, twin._next = set(self._live), self._next
        return twin

    def release(self, seq_id: int) -> int:
        """Retire a live id and return it; ``ValueError`` when it was already freed or never allocated."""
        sid = check_int("seq_id", seq_id, low=0)
        with self._lock:
            if sid not in self._live:
                state = "was already freed" if sid < self._next else "was never allocated"
                raise ValueError(f"cannot free seq_id {sid}: it {state}")
            self._live.discard(sid)
        return sid


def check_truncate_length(length: int, held: int, sid: int, layer: int) -> None:
    """``ValueError`` unless ``length`` (an int >= 0) is at most ``held``, the tokens of ``sid`` in ``layer``."""
    if length > held:
        raise ValueError(f"length must be in [0, {held}] (seq_len of seq_id {sid} in layer {layer}), received {length}")


class _Store(Protocol):
    """What :func:`fork_store` reads of a cache besides its per-layer list."""

    _locks: list[threading.Lock]
    _ids: SequenceIds


_S = TypeVar("_S", bound=_Store)


def fork_store(source: _S, attr: str, copy_entry: Callable[[Any], Any]) -> _S:
    """A copy of a multi-sequence cache ``source``: its own locks and sequence ids, and
    ``copy_entry`` of each entry of its per-layer list ``attr``, taken under every layer lock
    (in index order); everything else is shared (options, and state that is replaced, never
    written in place)."""
    twin = copy.copy(source)
    twin._locks = [threading.Lock() for _ in source._locks]
    for lock in source._locks:
        lock.acquire()
    try:
        setattr(twin, attr, [copy_entry(e) for e in getattr(source, attr)])
        twin._ids = source._ids.copy()
    finally:
        for lock in reversed(source._locks):
            lock.release()
    return twin
