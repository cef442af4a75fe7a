"""Say on screen when the CPU kernels are being compiled, and what, instead of a silent wait.

The Numba kernels are compiled on their first use for each signature (head size, bit width,
thread count) and cached on disk; on a loaded two-core machine a first fused decode has taken
minutes. :func:`compile_notice` listens to Numba's compile events: when a compilation has run
for ``after`` seconds it prints one line naming the kernel, and when the burst of compilations
ends, one line with the time it took. Nothing is printed when the compiled code comes from the
disk cache (no compile event) or compiles quickly.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from numba.core.event import Event

__all__ = ["compile_notice"]


class _Notice:
    def __init__(self, after: float, stream: TextIO) -> None:
        self.after = after
        self.stream = stream
        self.depth = 0
        self.started = 0.0
        self.printed = False
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()

    def on_start(self, ev: Event) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            self.started = time.perf_counter()
            name = _kernel_name(ev)
            self.timer = threading.Timer(self.after, self._say, args=(name,))
            self.timer.daemon = True
            self.timer.start()

    def on_end(self, ev: Event) -> None:
        with self.lock:
            self.depth = max(0, self.depth - 1)
            if self.depth:
                return
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.printed:
                took = time.perf_counter() - self.started
                print(
                    f"arraykv: compiled in {took:.0f} s (cached on disk for later runs)", file=self.stream, flush=True
                )
                self.printed = False

    def _say(self, name: str) -> None:
        with self.lock:
            if self.depth == 0:
                return
            self.printed = True
        print(
            f"arraykv: compiling the CPU kernel {name} (first use on this machine; this can take a few minutes) ...",
            file=self.stream,
            flush=True,
        )


def _kernel_name(ev: Event) -> str:
    data = getattr(ev, "data", None) or {}
    disp = data.get("dispatcher")
    py = getattr(disp, "py_func", None)
    name = getattr(py, "__qualname__", None) or getattr(disp, "__name__", "?")
    module = getattr(py, "__module__", "") or ""
    args = data.get("args")
    sig = f"({', '.join(str(a) for a in args)})" if args else ""
    if len(sig) > 120:
        sig = sig[:117] + "...)"
    return f"{module}.{name}{sig}" if module else f"{name}{sig}"


@contextlib.contextmanager
def compile_notice(after: float = 3.0, stream: TextIO | None = None) -> Iterator[None]:
    """Within the block, print a line when a Numba compilation runs longer than ``after`` seconds.

    Parameters
    ----------
    after : float, default 3.0
        Seconds a compilation may take before it is announced.
    stream : text stream, optional
        Where to print (standard error by default).
    """
    try:
        from numba.core import event
    except ImportError:  # no Numba: nothing is compiled
        yield
        return

    notice = _Notice(after, stream if stream is not None else sys.stderr)
    listener = type(
        "_CompileListener",
        (event.Listener,),
        {
            "on_start": lambda self, ev: notice.on_start(ev),
            "on_end": lambda self, ev: notice.on_end(ev),
        },
    )()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)
        if notice.timer is not None:
            notice.timer.cancel()
