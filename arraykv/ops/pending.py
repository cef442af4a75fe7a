"""Kernel compilations running in other processes, for code about to use those kernels to wait for.

A process that starts a child compiling kernels into Numba's disk cache
(:mod:`arraykv.integrations.decoder.precompile`) registers it here with the cache methods it covers;
code about to create a cache of a method calls :func:`wait` first, so that it loads the compiled
kernels from the disk cache instead of compiling them a second time beside the child.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["Job", "register", "wait", "pending_methods"]


class Job(Protocol):
    """A compilation in another process: the methods it covers, and how to wait for it."""

    methods: tuple

    def wait(self, timeout: float | None = None) -> bool: ...

    def done(self) -> bool: ...


_JOBS: list = []
_LOCK = threading.Lock()


def register(job: Job) -> None:
    """Register a running compilation (:class:`Job`)."""
    with _LOCK:
        _JOBS.append(job)


def pending_methods() -> set:
    """The methods of the registered compilations still running."""
    with _LOCK:
        return {m for j in _JOBS if not j.done() for m in j.methods}


def wait(method: str | None = None, timeout: float | None = None) -> None:
    """Wait for the registered compilations covering ``method`` (all of them when None).

    Parameters
    ----------
    method : str, optional
        A cache method name; compilations of other methods go on without waiting.
    timeout : float, optional
        Seconds to wait for each at most (None: until it ends).

    A compilation that fails is not an error here: the caller's first call compiles what it
    needs itself. Finished compilations are forgotten.
    """
    with _LOCK:
        jobs = [j for j in _JOBS if method is None or method in j.methods]
    for j in jobs:
        j.wait(timeout)
    with _LOCK:
        _JOBS[:] = [j for j in _JOBS if not j.done()]
