"""Names for short-lived files that say which process wrote them, and the removal of a dead one's.

A rewritten ONNX graph is written to disk for the moment ONNX Runtime opens it
(:mod:`arraykv.integrations.onnxruntime.graph_files`) and removed right after. A process killed in
between (``SIGKILL``, a power cut) cannot remove it; the next process that writes into the same
folder does, once it can tell that the writer is dead. So every such name carries its owner:

``<prefix><machine>-<boot>-<pid>-<start>-<random>``

- ``machine``: 8 hex digits of a hash of the host name and the PID namespace. Files of another
  machine (a shared network folder) or of another PID namespace (a container) are never
  touched: their processes cannot be seen from here.
- ``boot``: 8 hex digits of a hash of the kernel's boot id (Linux; empty elsewhere). A file of
  this machine from an earlier boot has a dead owner.
- ``pid`` and ``start``: the owner's process id and its start time in clock ticks since boot
  (``/proc/<pid>/stat``, Linux; 0 elsewhere). On Linux an owner is alive while a process of that
  id and that start time runs and is not a zombie, so a reused process id does not keep a file;
  on other POSIX systems while a process of that id exists (``kill(pid, 0)``: a reused id keeps
  the file, never the reverse). On Windows nothing is removed.

A live process's file is never removed: every doubt counts as alive.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid

__all__ = ["owned_name", "remove_stale"]

_TAG = r"(?P<machine>[0-9a-f]{8})-(?P<boot>[0-9a-f]{0,8})-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]{12}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return _digest(socket.gethostname() + "\0" + namespace)


def _boot() -> str:
    boot = _read("/proc/sys/kernel/random/boot_id")
    return _digest(boot) if boot else ""


def _stat(pid: int) -> tuple | None:
    """``(state, start time)`` of process ``pid`` from ``/proc``, or None where it has no entry."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold anything
    return fields[0], int(fields[19])


def _start(pid: int) -> int:
    got = _stat(pid) if os.path.isdir("/proc/self") else None
    return 0 if got is None else got[1]


def owned_name(prefix: str, suffix: str = "") -> str:
    """A new name ``prefix + <owner tag> + suffix`` owned by this process (module notes).

    Parameters
    ----------
    prefix, suffix : str
        ``prefix`` starts the name (for example ``".arraykv-"``); :func:`remove_stale` is given
        the same prefix and suffixes.

    Returns
    -------
    str
        A file name, not a path; unique (random part of 48 bits).
    """
    pid = os.getpid()
    return f"{prefix}{_machine()}-{_boot()}-{pid}-{_start(pid)}-{uuid.uuid4().hex[:12]}{suffix}"


def _owner_dead(machine: str, boot: str, pid: int, start: int) -> bool:
    if machine != _machine() or os.name == "nt":
        return False  # another machine's or namespace's process: not ours to judge
    if boot != _boot():
        return True  # written before this machine last started
    if os.path.isdir("/proc/self"):
        got = _stat(pid)
        return got is None or got[1] != start or got[0] in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by another user
    return False


def remove_stale(folder: str, prefix: str, suffixes: tuple = ("",)) -> list:
    """Remove the files and folders in ``folder`` named by :func:`owned_name` whose owner is dead.

    Parameters
    ----------
    folder : str
        Not searched recursively; a folder that cannot be listed is left alone.
    prefix : str
    suffixes : tuple of str
        The suffixes the owner may have added (``""`` for folders made with no suffix).

    Returns
    -------
    list of str
        The paths removed.
    """
    ends = "|".join(re.escape(s) for s in sorted(suffixes, key=len, reverse=True))
    pattern = re.compile(re.escape(prefix) + _TAG + f"(?:{ends})$")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        m = pattern.match(name)
        if m is None or not _owner_dead(m["machine"], m["boot"], int(m["pid"]), int(m["start"])):
            continue
        path = os.path.join(folder, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass  # another process removed it first
        except OSError:
            continue
        removed.append(path)
    return removed
