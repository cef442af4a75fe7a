"""When a Numba kernel with ``prange`` loops should run on the calling thread alone.

Waking Numba's worker threads costs tens of microseconds on an idle machine and milliseconds
on a busy one, more than a decode step's small kernels take on one thread. Kernels that may be
called on a few rows (one new token, a few heads) wrap their call in :func:`threads_for`.
"""

from __future__ import annotations

import contextlib

try:
    import numba as nb
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

__all__ = ["threads_for", "PARALLEL_MIN_VALUES"]

#: Below this many values (elements read or written) a kernel runs on the calling thread.
PARALLEL_MIN_VALUES = 1 << 20


@contextlib.contextmanager
def threads_for(values: int, min_values: int | None = None):
    """Run the enclosed kernels on one thread when ``values < min_values``.

    Numba's thread count is a per-thread setting, so other threads are not affected.
    ``min_values`` defaults to :data:`PARALLEL_MIN_VALUES` (read at call time).
    """
    limit = PARALLEL_MIN_VALUES if min_values is None else min_values
    if values >= limit:
        yield
        return
    saved = nb.get_num_threads()
    nb.set_num_threads(1)
    try:
        yield
    finally:
        nb.set_num_threads(saved)
