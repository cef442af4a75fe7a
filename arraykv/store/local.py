"""The embedded backend: one file per entry in a local folder, shared by any number of processes.

Layout: ``ROOT/v1/ab/abcdef....akv`` (the first two hex digits of the key name a subfolder),
each file an entry's bytes (a cache file :func:`arraykv.load` reads).

Concurrency without locks:

- a writer writes a temporary file in the entry's folder (``.tmp-*``), flushes and fsyncs it,
  renames it over the entry's name (``os.replace``, atomic on POSIX and Windows) and fsyncs the
  folder: a reader opens either the old file or the new one, never a part; a writer that dies
  leaves only a temporary file, which no reader opens and :meth:`LocalStore.evict` removes
  once it is older than :data:`STALE_TMP_SECONDS`;
- two writers of one key: the last rename wins, both files whole;
- a reader holds an open file: an eviction that unlinks it meanwhile does not disturb the read;
- recency: :meth:`LocalStore.touch`, which a reader calls once the entry it read was accepted,
  sets the file's access time (``os.utime``, whatever the mount's ``noatime``); a read alone does
  not, so a damaged entry that is read and refused stays first in line for eviction. Eviction
  drops the files used longest ago; the modification time is the creation time (the rename
  keeps the writer's), which the TTL counts from.

Size: by default the entries' total is kept under :data:`DEFAULT_MAX_BYTES` (10 GiB) or half
the size of the file system that holds the folder, whichever is smaller (``max_bytes="auto"``);
``max_bytes=None`` lifts the bound.

Whatever else is found at an entry's path (a folder, a FIFO, a device, a symbolic link, a loop
of links, a file where a subfolder should be, an unreadable file) is a
:class:`~arraykv.store.backend.StoreError`: entry files are opened without following links and
without blocking (``O_NOFOLLOW | O_NONBLOCK``), checked to be regular files (``fstat``) and to
start with the cache file's magic number before the rest is read, and never read past the
size checked against ``max_entry_bytes``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import BinaryIO

from ..storage.cache_file import MAGIC
from .backend import DEFAULT_MAX_ENTRY_BYTES, EntryError, EntryInfo, StoreError, check_key, check_limit
from .binding import ENTRY_MAGIC
from .entry import HEADER_LIMIT, peek_entry

__all__ = ["LocalStore", "STALE_TMP_SECONDS", "DEFAULT_MAX_BYTES"]

#: The default bound of a folder store's entries (``max_bytes="auto"``), unless half the file
#: system is smaller.
DEFAULT_MAX_BYTES = 10 << 30
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS |= getattr(os, "O_BINARY", 0)
_NOATIME = getattr(os, "O_NOATIME", 0)

#: Age after which a temporary file is taken for a dead writer's and removed by ``evict``.
STALE_TMP_SECONDS = 3600.0
_SUFFIX = ".akv"


class LocalStore:
    """Entries as files under ``root`` (created if missing).

    Parameters
    ----------
    root : str or path-like
        The store's folder (``~`` expanded), created if missing; several processes may use it
        at once. One that cannot be made (a file in the way, no rights) is no error here: every
        use then fails with a :class:`~arraykv.store.backend.StoreError`.
    max_bytes : int, "auto" or None, default "auto"
        Budget of the entries' total size: after each ``put`` the least recently used entries
        are removed until the total is at most this. "auto": :data:`DEFAULT_MAX_BYTES` or half
        the size of the folder's file system, whichever is smaller. None: no budget.
    ttl : float, optional
        Seconds an entry is served after it was written; older ones are misses and are removed
        by ``evict``. None: no expiry.
    max_entry_bytes : int, default 4 GiB
        Larger entries are refused by ``get`` (before anything is read) and by ``put``.
    fsync : bool, default True
        Flush each entry and its folder to the disk before it becomes visible (crash-safe);
        False trades that for speed (a power loss may then leave an empty entry, which the
        checked format refuses).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        max_bytes: int | str | None = "auto",
        ttl: float | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        fsync: bool = True,
    ):
        if max_bytes != "auto":
            check_limit("max_bytes", max_bytes)  # before the folder is made
        self.ttl = check_limit("ttl", ttl)
        self.max_entry_bytes = int(check_limit("max_entry_bytes", max_entry_bytes, allow_none=False))
        self.fsync = bool(fsync)
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        self._base = os.path.join(self.root, "v1")
        # made now where it can be; where it cannot (a file in the way, no rights, a full disk),
        # every use fails with a StoreError instead, which a PrefixStore turns into warnings
        with contextlib.suppress(OSError):
            os.makedirs(self._base, exist_ok=True)
        self.max_bytes = _auto_budget(self._base) if max_bytes == "auto" else check_limit("max_bytes", max_bytes)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r}, max_bytes={self.max_bytes}, ttl={self.ttl})"

    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s entry (it may not exist).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        str
            ``root/v1/<first two digits>/<key>.akv``.
        """
        key = check_key(key)
        return os.path.join(self._base, key[:2], key + _SUFFIX)

    # -- the interface --------------------------------------------------------------
    def get(self, key: str) -> bytes | bytearray | None:
        """The entry's bytes, or None when there is no file or it expired (see :meth:`StoreBackend.get`).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bytearray or None
            The file's bytes (a ``bytearray``: one buffer, filled in place); None for a miss.
            Reading is not a use: :meth:`touch` marks the entry once it was accepted.
        """
        path = self.path_of(key)
        fd = self._open(path, key)
        if fd is None:
            return None
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if self._expired(st.st_mtime):
                return None
            size = st.st_size
            if size > self.max_entry_bytes:
                raise EntryError(
                    f"entry {key[:16]}... declares {size} bytes, more than max_entry_bytes="
                    f"{self.max_entry_bytes}; not read"
                )
            magic = f.read(len(MAGIC))  # before anything of the entry's size is allocated
            if magic not in (MAGIC, ENTRY_MAGIC):  # a store entry (binding.py) or a bare cache file
                raise EntryError(f"entry {key[:16]}... is not a cache file (bad magic number); not read")
            data = bytearray(size)  # the one buffer: never more than the size checked above
            view = memoryview(data)
            view[: len(MAGIC)] = magic
            got = len(MAGIC) + _read_into(f, view[len(MAGIC) :])
            del view
        if got != size:
            raise EntryError(f"entry {key[:16]}... holds {got} bytes, its file declares {size}")
        return data

    def touch(self, key: str) -> bool:
        """Mark ``key``'s entry as used now (its access time); whether there was one.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when a regular file was held and marked.
        """
        path = self.path_of(key)
        st = _lstat(path)
        if st is None or not stat.S_ISREG(st.st_mode):
            return False
        try:
            os.utime(path, (time.time(), st.st_mtime), follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot mark entry {key[:16]}... as used: {exc}") from None
        return True

    def _open(self, path: str, key: str) -> int | None:
        """A descriptor of ``path`` if it is a regular file, None if there is nothing; else a StoreError.

        Opened without following a link and without blocking (a FIFO or a device cannot hang
        the reader); the type is checked on the open file, so nothing can be swapped in between.
        """
        try:
            try:
                fd = os.open(path, _OPEN_FLAGS | _NOATIME)  # a read is not a use: the access time stays
            except PermissionError:  # O_NOATIME is for the file's owner only
                if not _NOATIME:
                    raise
                fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            what = "a symbolic link" if exc.errno in (errno.ELOOP, errno.EMLINK) else os.strerror(exc.errno or 0)
            raise StoreError(f"entry {key[:16]}... cannot be read at {path}: {what}") from None
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"entry {key[:16]}... cannot be read at {path}: {exc}") from None
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise StoreError(f"entry {key[:16]}... at {path} is not a regular file ({_kind(mode)})")
        return fd

    def put(self, key: str, data: bytes, *, tokens: int | None = None) -> None:
        """Write ``data`` to a temporary file, then rename it over ``key``'s file; evict to ``max_bytes``.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.
        data : bytes
            The entry (bytes-like), at most ``max_entry_bytes``.
        tokens : int, optional
            Not stored: :meth:`entries` reads the tokens from the entry's header.
        """
        path = self.path_of(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, received {type(data).__name__}")
        if len(data) > self.max_entry_bytes:
            raise EntryError(f"an entry of {len(data)} bytes is more than max_entry_bytes={self.max_entry_bytes}")
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=folder)
        except OSError as exc:
            raise StoreError(f"cannot write to the store folder {folder}: {exc}") from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot write entry {key[:16]}... to {folder}: {exc}") from None
            raise
        if self.fsync:
            _fsync_dir(folder)
        if self.max_bytes is not None:
            self.evict()

    def contains(self, key: str) -> bool:
        """Whether ``key``'s file exists and has not expired.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True for an unexpired entry (a regular file: what else is at the path is no entry,
            and ``put`` replaces it where it can).
        """
        st = _lstat(self.path_of(key))
        return st is not None and stat.S_ISREG(st.st_mode) and not self._expired(st.st_mtime)

    def delete(self, key: str) -> bool:
        """Remove ``key``'s file; whether there was one.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when a file was removed.
        """
        try:
            os.unlink(self.path_of(key))
            return True
        except FileNotFoundError:
            return False

    def entries(self) -> list:
        """Every entry file, as :class:`~arraykv.store.backend.EntryInfo`.

        Returns
        -------
        list of EntryInfo
            One per entry file (expired ones included, until :meth:`evict`); ``tokens`` from the
            entry's header, None where it cannot be read.
        """
        out = []
        for path, st in self._files():
            key = os.path.basename(path)[: -len(_SUFFIX)]
            info = None
            with contextlib.suppress(OSError, StoreError):
                fd = self._open(path, key)
                if fd is not None:
                    with os.fdopen(fd, "rb") as f:
                        info = peek_entry(_head(f))
            out.append(
                EntryInfo(
                    key=key,
                    nbytes=st.st_size,
                    tokens=None if info is None else info["tokens"],
                    created=st.st_mtime,
                    last_used=max(st.st_atime, st.st_mtime),
                    expires=None if self.ttl is None else st.st_mtime + self.ttl,
                )
            )
        return out

    def evict(self, max_bytes: int | None = None) -> list:
        """Remove expired entries and stale temporary files, then least recently used entries to the budget.

        Parameters
        ----------
        max_bytes : int, optional
            The budget; default :attr:`max_bytes` (None: no budget, only expiry).

        Returns
        -------
        list of str
            Keys of the entries removed (temporary files not listed).
        """
        budget = self.max_bytes if max_bytes is None else check_limit("max_bytes", max_bytes)
        now = time.time()
        dropped, alive = [], []
        for path, st in self._files(tmp_too=True):
            name = os.path.basename(path)
            if name.startswith(".tmp-"):
                if now - st.st_mtime > STALE_TMP_SECONDS:
                    _unlink(path)
                continue
            if self._expired(st.st_mtime, now):
                if _unlink(path):
                    dropped.append(name[: -len(_SUFFIX)])
                continue
            alive.append((max(st.st_atime, st.st_mtime), st.st_size, path))
        if budget is not None:
            total = sum(size for _, size, _ in alive)
            for _, size, path in sorted(alive):
                if total <= budget:
                    break
                if _unlink(path):
                    dropped.append(os.path.basename(path)[: -len(_SUFFIX)])
                total -= size
        return dropped

    # -- helpers ----------------------------------------------------------------------
    def total_bytes(self) -> int:
        """Bytes of the entries held (temporary files excluded).

        Returns
        -------
        int
            The sizes of the entry files, summed.
        """
        return sum(st.st_size for _, st in self._files())

    def _expired(self, mtime: float, now: float | None = None) -> bool:
        return self.ttl is not None and (time.time() if now is None else now) - mtime > self.ttl

    def _files(self, *, tmp_too: bool = False) -> Iterator[tuple[str, os.stat_result]]:
        """``(path, stat)`` of every entry file (and temporary file), skipping ones that vanish."""
        try:
            folders = os.listdir(self._base)
        except OSError:
            return
        for sub in folders:
            folder = os.path.join(self._base, sub)
            st = _lstat(folder)
            if st is None or not stat.S_ISDIR(st.st_mode):
                continue  # a file or a link where a subfolder should be: not the store's
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if not name.endswith(_SUFFIX) or (name.startswith(".tmp-") and not tmp_too):
                    continue
                path = os.path.join(folder, name)
                st = _lstat(path)
                if st is not None and stat.S_ISREG(st.st_mode):
                    yield path, st


def _head(f: BinaryIO) -> bytes:
    """The first bytes of an entry file: its prefix and header, at most ``HEADER_LIMIT``."""
    head = f.read(20)
    if len(head) < 20:
        return head
    hlen = int.from_bytes(head[12:20], "little")
    return head + f.read(min(hlen, HEADER_LIMIT))


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _lstat(path: str) -> os.stat_result | None:
    """``os.lstat(path)``, None when nothing (or nothing reachable) is there."""
    try:
        return os.lstat(path)
    except OSError:
        return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``f``; the bytes read (fewer only at the file's end)."""
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            break
        got += k
    return got


def _auto_budget(folder: str) -> int:
    """:data:`DEFAULT_MAX_BYTES`, or half the size of ``folder``'s file system if that is smaller."""
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # not made (yet): the file system it would be on
    try:
        vfs = os.statvfs(folder)
        return max(1, min(DEFAULT_MAX_BYTES, vfs.f_frsize * vfs.f_blocks // 2))
    except (OSError, AttributeError):  # no statvfs (Windows)
        return DEFAULT_MAX_BYTES


def _fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
