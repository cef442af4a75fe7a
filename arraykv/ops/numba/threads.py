"""The one threading policy of the CPU kernels: how many threads a call gets, and when it waits.

Serial below a size
    Waking Numba's worker threads costs tens of microseconds on an idle machine and
    milliseconds on a busy one, more than a decode step's small kernels take on one thread.
    Every kernel states its work in *values* (elements read or written, or codes read) and
    :func:`threads_for` gives it one thread below :data:`PARALLEL_MIN_WORK` values, all of
    this Python thread's Numba threads from there on. :func:`serial_below` changes the size
    for the length of a ``with`` block (tests use it to force either path).

Thread safety under every threading layer
    Numba's ``workqueue`` threading layer (the one it falls back to where neither OpenMP nor
    TBB is installed) aborts the process when two Python threads are inside ``parallel=True``
    functions at once, even when each asked for one thread. :func:`launch` therefore holds one
    process-wide lock around every call of a ``parallel=True`` function while the layer in use
    is not known to be thread-safe: ``workqueue`` (asked for through
    ``NUMBA_THREADING_LAYER`` or found by :func:`numba.threading_layer` after the first
    launch), and any launch before the first one has told which layer was picked. Under
    ``omp`` and ``tbb`` launches do not wait for each other. Functions compiled without
    ``parallel`` (the serial variants) never take the lock.

Serial beside a threaded BLAS
    OpenBLAS's worker threads spin for a while after every product instead of sleeping, so a
    ``parallel=True`` region launched between two of NumPy's matrix products (what a decoder
    does in every layer) waits for cores the spinning threads hold: measured on 2 cores, a
    SmolLM2-shape fused step at 8k tokens took 0.6 ms on two Numba threads alone, 7.6 ms with
    a two-thread OpenBLAS product before each call, and 1.1 ms serially. So while the OpenBLAS
    that NumPy uses runs more than one thread (:func:`blas_threads`), kernels run serially;
    with ``OPENBLAS_NUM_THREADS=1`` they use every Numba thread. The same holds beside torch's
    own intra-op threads (a transformers model's products run there, not in OpenBLAS): once
    torch is imported, its thread count counts as the BLAS's. :func:`beside_blas` changes
    the rule (``"parallel"`` for code that calls no BLAS between kernel calls).

Numba's thread count is a per-thread setting, so a launch never changes another thread's.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
import threading
from collections.abc import Callable, Iterator

import numba as nb

__all__ = [
    "PARALLEL_MIN_WORK",
    "threads_for",
    "serial_below",
    "launch",
    "launches_serialized",
    "blas_threads",
    "beside_blas",
]

#: Below this many values (elements read or written, codes read) a kernel runs on the calling
#: thread alone (measured: 0.46 ms on one thread against 16 ms on two for a 3-head ×
#: 100-token decode step on a busy 2-core machine).
PARALLEL_MIN_WORK = 1 << 20

_override = threading.local()
_LAUNCH_LOCK = threading.RLock()
#: True once the threading layer in use is known to be thread-safe, False once known not to be.
_layer_safe: bool | None = None


def _min_work() -> int:
    return getattr(_override, "min_work", PARALLEL_MIN_WORK)


def threads_for(work: int) -> int:
    """Threads for a call of ``work`` values: 1 below the threshold or beside a threaded BLAS
    (see the module notes), else this thread's Numba count."""
    if work < _min_work():
        return 1
    n = max(1, nb.get_num_threads())
    if n > 1 and getattr(_override, "beside_blas", _BESIDE_BLAS) == "serial" and blas_threads() > 1:
        return 1
    return n


#: What kernels do while NumPy's OpenBLAS runs several threads: "serial" or "parallel".
_BESIDE_BLAS = os.environ.get("ARRAYKV_BESIDE_BLAS", "serial")
_BLAS_GET: list = []


def blas_threads() -> int:
    """Threads of the BLAS running beside the kernels: the OpenBLAS that NumPy links (asked
    through its C API; 1 when it cannot be asked), or torch's intra-op threads once torch is
    imported, whichever is more."""
    if not _BLAS_GET:
        _BLAS_GET.append(_find_blas_get())
    get = _BLAS_GET[0]
    n = 1 if get is None else max(1, int(get()))
    torch = sys.modules.get("torch")
    get_torch = getattr(torch, "get_num_threads", None)
    if callable(get_torch):
        n = max(n, int(get_torch()))
    return n


def _find_blas_get() -> Callable[[], int] | None:
    import numpy as np

    base = os.path.dirname(np.__file__)
    for path in sorted(
        glob.glob(os.path.join(base, "..", "numpy.libs", "*openblas*"))
        + glob.glob(os.path.join(base, ".dylibs", "*openblas*"))
    ):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in (
            "scipy_openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_",
            "openblas_get_num_threads",
        ):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                found: Callable[[], int] = fn
                return found
    return None


@contextlib.contextmanager
def beside_blas(mode: str) -> Iterator[None]:
    """Within the block, this Python thread's kernels run ``"serial"`` or ``"parallel"`` while
    NumPy's OpenBLAS runs several threads (the default is ``"serial"``, or the environment
    variable ``ARRAYKV_BESIDE_BLAS``)."""
    if mode not in ("serial", "parallel"):
        raise ValueError(f"mode must be 'serial' or 'parallel', received {mode!r}")
    saved = getattr(_override, "beside_blas", None)
    _override.beside_blas = mode
    try:
        yield
    finally:
        if saved is None:
            del _override.beside_blas
        else:
            _override.beside_blas = saved


@contextlib.contextmanager
def serial_below(min_work: int) -> Iterator[None]:
    """Within the block, calls of this Python thread run serially below ``min_work`` values.

    ``serial_below(0)`` sends every call to the threaded path, ``serial_below(1 << 62)`` keeps
    every call on the calling thread. The previous setting comes back on exit.
    """
    saved = getattr(_override, "min_work", None)
    _override.min_work = int(min_work)
    try:
        yield
    finally:
        if saved is None:
            del _override.min_work
        else:
            _override.min_work = saved


def launches_serialized() -> bool:
    """Whether parallel launches currently wait for each other (the layer is not known to be safe)."""
    global _layer_safe
    if _layer_safe is not None:
        return not _layer_safe
    if str(getattr(nb.config, "THREADING_LAYER", "")).lower() == "workqueue":
        _layer_safe = False
        return True
    try:
        layer = nb.threading_layer()
    except ValueError:  # no parallel launch yet: the layer is picked at the first one
        return True
    _layer_safe = layer != "workqueue"
    return not _layer_safe


@contextlib.contextmanager
def launch(work: int) -> Iterator[int]:
    """Context of one call of ``parallel=True`` kernels over ``work`` values; yields the thread count.

    Sets this Python thread's Numba thread count to :func:`threads_for` for the block (restored
    afterwards) and holds the process-wide launch lock while :func:`launches_serialized`.
    """
    threads = threads_for(work)
    lock = _LAUNCH_LOCK if launches_serialized() else None
    if lock is not None:
        lock.acquire()
    saved = nb.get_num_threads()
    try:
        if threads != saved:
            nb.set_num_threads(threads)
        yield threads
    finally:
        if threads != saved:
            nb.set_num_threads(saved)
        if lock is not None:
            lock.release()
