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
- recency: a read sets the file's access time (``os.utime``, whatever the mount's ``noatime``);
  eviction drops the files read longest ago; the modification time is the creation time (the
  rename keeps the writer's), which the TTL counts from.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import BinaryIO

from .backend import DEFAULT_MAX_ENTRY_BYTES, EntryError, EntryInfo, StoreError, check_key, check_limit
from .entry import HEADER_LIMIT, peek_entry

__all__ = ["LocalStore", "STALE_TMP_SECONDS"]

#: Age after which a temporary file is taken for a dead writer's and removed by ``evict``.
STALE_TMP_SECONDS = 3600.0
_SUFFIX = ".akv"


class LocalStore:
    """Entries as files under ``root`` (created if missing).

    Parameters
    ----------
    root : str or path-like
        The store's folder (``~`` expanded); several processes may use it at once.
    max_bytes : int, optional
        Budget of the entries' total size: after each ``put`` the least recently used entries
        are removed until the total is at most this. None: no budget.
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
        max_bytes: int | None = None,
        ttl: float | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        fsync: bool = True,
    ):
        self.max_bytes = check_limit("max_bytes", max_bytes)
        self.ttl = check_limit("ttl", ttl)
        self.max_entry_bytes = int(check_limit("max_entry_bytes", max_entry_bytes, allow_none=False))
        self.fsync = bool(fsync)
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        self._base = os.path.join(self.root, "v1")
        try:
            os.makedirs(self._base, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store folder {self._base}: {exc}") from None

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
    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None when there is no file or it expired (see :meth:`StoreBackend.get`).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bytes or None
            The file's bytes; None for a miss. A hit marks the file as used (its access time).
        """
        path = self.path_of(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        with f:
            st = os.fstat(f.fileno())
            if self._expired(st.st_mtime):
                return None
            size = st.st_size
            if size > self.max_entry_bytes:
                raise EntryError(
                    f"entry {key[:16]}... declares {size} bytes, more than max_entry_bytes="
                    f"{self.max_entry_bytes}; not read"
                )
            data = f.read(size)  # never more than the size checked above
        if len(data) != size:
            raise EntryError(f"entry {key[:16]}... holds {len(data)} bytes, its file declares {size}")
        with contextlib.suppress(OSError):  # recency for eviction; the file may be gone already
            os.utime(path, (time.time(), st.st_mtime))
        return data

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
            True for an unexpired entry.
        """
        try:
            return not self._expired(os.stat(self.path_of(key)).st_mtime)
        except FileNotFoundError:
            return False

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
            with contextlib.suppress(OSError):
                with open(path, "rb") as f:
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
        except FileNotFoundError:
            return
        for sub in folders:
            folder = os.path.join(self._base, sub)
            try:
                names = os.listdir(folder)
            except (NotADirectoryError, FileNotFoundError):
                continue
            for name in names:
                if not name.endswith(_SUFFIX) or (name.startswith(".tmp-") and not tmp_too):
                    continue
                path = os.path.join(folder, name)
                try:
                    yield path, os.stat(path)
                except FileNotFoundError:
                    continue


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
    except FileNotFoundError:
        return False


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
