"""The server backend: entries in a Valkey or Redis server that any process or machine reaches.

One entry is one hash, ``{prefix}e:{key}``, with the fields ``data`` (the entry's bytes),
``nbytes`` (their declared length), ``sha256`` (their digest, hex), ``tokens`` and ``created``.

Writing: one ``MULTI``/``EXEC`` transaction deletes the key, sets every field and the TTL. The
server applies a transaction whole or not at all: a writer that dies (or loses the server)
before ``EXEC`` has arrived whole leaves nothing, and no reader ever sees a hash with some
fields set. Two writers of one key: one transaction runs after the other, each entry whole.

Reading: one server-side script checks, atomically, that ``nbytes`` is a number no larger than
the reader's ``max_entry_bytes`` and equal to the length of ``data`` (``HSTRLEN``) and that
``sha256`` is 64 characters, and only then returns the fields: the client never receives (so
never allocates) more than the declared, checked size. The digest is checked after the
transfer; the bytes then go through the cache file reader's own checks
(:mod:`arraykv.store.entry`).

Eviction: by size on the server (``maxmemory`` with ``allkeys-lru`` or ``volatile-lru``:
:meth:`ValkeyStore.set_memory_limit`, or :class:`~arraykv.store.server.ValkeyServer`'s
``maxmemory``), which drops whole hashes; by time with a TTL on every entry (``ttl=``), which the
server enforces itself. :meth:`ValkeyStore.evict` also trims to a byte budget from the client,
least recently used first (``OBJECT IDLETIME``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from .backend import DEFAULT_MAX_ENTRY_BYTES, EntryError, EntryInfo, StoreError, check_key, check_limit

__all__ = ["ValkeyStore", "connect"]

# KEYS[1] the entry; ARGV[1] max_entry_bytes. Replies: nil (no entry), {-1, why} (refused),
# {0, data, sha256, tokens}.
_GET_SCRIPT = """
local n = redis.call('HGET', KEYS[1], 'nbytes')
if not n then
  if redis.call('EXISTS', KEYS[1]) == 1 then return {-1, 'no nbytes field'} end
  return nil
end
if string.len(n) > 15 or not string.match(n, '^%d+$') then return {-1, 'nbytes is not a number'} end
local size = tonumber(n)
if size > tonumber(ARGV[1]) then return {-1, 'declares ' .. n .. ' bytes, more than max_entry_bytes=' .. ARGV[1]} end
local held = redis.call('HSTRLEN', KEYS[1], 'data')
if held ~= size then return {-1, 'declares ' .. n .. ' bytes but holds ' .. held} end
if redis.call('HSTRLEN', KEYS[1], 'sha256') ~= 64 then return {-1, 'sha256 is not 64 characters'} end
local tokens = redis.call('HGET', KEYS[1], 'tokens') or ''
if string.len(tokens) > 20 then tokens = '' end
return {0, redis.call('HGET', KEYS[1], 'data'), redis.call('HGET', KEYS[1], 'sha256'), tokens}
"""


def connect(url: str, **kwargs: Any) -> Any:
    """A client for ``url`` (``redis://host:port/db``): the ``valkey`` package's, else ``redis``'s.

    Raises
    ------
    ImportError
        Neither client is installed (``pip install "arraykv[store]"``).
    """
    try:
        import valkey

        cls = valkey.Valkey
    except ImportError:
        try:
            import redis

            cls = redis.Redis
        except ImportError:
            raise ImportError(
                'the Valkey backend needs the valkey (or redis) client: pip install "arraykv[store]"'
            ) from None
    return cls.from_url(url, **kwargs)


def _errors() -> tuple:
    """The client libraries' base error classes (connection lost, server errors), those installed."""
    out = []
    try:
        from valkey.exceptions import ValkeyError

        out.append(ValkeyError)
    except ImportError:
        pass
    try:
        from redis.exceptions import RedisError

        out.append(RedisError)
    except ImportError:
        pass
    return tuple(out) or (OSError,)


class ValkeyStore:
    """Entries in a Valkey/Redis server.

    Parameters
    ----------
    client : str or client object
        A URL (``redis://127.0.0.1:6379/0``; :func:`connect`) or a ``valkey.Valkey`` /
        ``redis.Redis`` client.
    prefix : str, default "arraykv:"
        Prefix of every key this store writes (several stores can share a server).
    ttl : float, optional
        Seconds each entry lives (set on write; the server removes it). None: no expiry.
    max_bytes : int, optional
        Budget :meth:`evict` trims to when not given one. The server's own ``maxmemory``
        (:meth:`set_memory_limit`) is what bounds it between calls.
    max_entry_bytes : int, default 4 GiB
        Larger entries are refused (on the server, before any byte is sent) by ``get``, and by
        ``put``.
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "arraykv:",
        ttl: float | None = None,
        max_bytes: int | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ):
        if not isinstance(prefix, str) or not prefix or any(c.isspace() or c in "*?[]" for c in prefix):
            raise ValueError(
                f"prefix must be a non-empty string without spaces or glob characters, received {prefix!r}"
            )
        self.ttl = check_limit("ttl", ttl)
        self.max_bytes = check_limit("max_bytes", max_bytes)
        self.max_entry_bytes = int(check_limit("max_entry_bytes", max_entry_bytes, allow_none=False))
        self.client = connect(client) if isinstance(client, str) else client
        self.prefix = prefix
        self._errors = _errors()
        self._get = self.client.register_script(_GET_SCRIPT)

    def __repr__(self) -> str:
        return f"ValkeyStore({self.client!r}, prefix={self.prefix!r}, ttl={self.ttl})"

    def name_of(self, key: str) -> str:
        """The server key of ``key``'s entry.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        str
            ``<prefix>e:<key>``.
        """
        return f"{self.prefix}e:{check_key(key)}"

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise StoreError(f"the server could not {what}: {exc}") from None

    # -- the interface --------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The entry's bytes, checked against its SHA-256, or None for a miss (see :meth:`StoreBackend.get`).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bytes or None
            The entry's bytes; None when the server holds none (or it expired).
        """
        name = self.name_of(key)
        reply = self._call("read an entry", self._get, keys=[name], args=[self.max_entry_bytes])
        if reply is None:
            return None
        if not isinstance(reply, list) or not reply:
            raise EntryError(f"entry {key[:16]}...: unexpected reply from the server")
        if reply[0] != 0:
            why = reply[1].decode(errors="replace") if len(reply) > 1 and isinstance(reply[1], bytes) else "?"
            raise EntryError(f"entry {key[:16]}... refused: {why}")
        data: bytes = reply[1]
        digest = reply[2].decode("ascii", errors="replace")
        if hashlib.sha256(data).hexdigest() != digest:
            raise EntryError(f"entry {key[:16]}... is corrupted (its bytes do not match its sha256)")
        return data

    def put(self, key: str, data: bytes, *, tokens: int | None = None) -> None:
        """Store ``data`` with its size, SHA-256, ``tokens`` and time in one transaction (``ttl`` set).

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.
        data : bytes
            The entry (bytes-like), at most ``max_entry_bytes``.
        tokens : int, optional
            Prefix tokens the entry holds, reported by :meth:`entries`.
        """
        name = self.name_of(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, received {type(data).__name__}")
        data = bytes(data)
        if len(data) > self.max_entry_bytes:
            raise EntryError(f"an entry of {len(data)} bytes is more than max_entry_bytes={self.max_entry_bytes}")
        fields = {
            "data": data,
            "nbytes": str(len(data)),
            "sha256": hashlib.sha256(data).hexdigest(),
            "tokens": "" if tokens is None else str(int(tokens)),
            "created": repr(time.time()),
        }
        pipe = self.client.pipeline(transaction=True)  # MULTI ... EXEC: all fields or none
        pipe.delete(name)
        pipe.hset(name, mapping=fields)
        if self.ttl is not None:
            pipe.pexpire(name, max(1, int(self.ttl * 1000)))
        self._call("store an entry", pipe.execute)

    def contains(self, key: str) -> bool:
        """Whether the server holds ``key``'s entry.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when the entry's server key exists (the server drops expired ones).
        """
        return bool(self._call("look an entry up", self.client.exists, self.name_of(key)))

    def delete(self, key: str) -> bool:
        """Remove ``key``'s entry from the server; whether there was one.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when an entry was removed.
        """
        return bool(self._call("delete an entry", self.client.delete, self.name_of(key)))

    def entries(self) -> list:
        """Every entry under :attr:`prefix`, as :class:`~arraykv.store.backend.EntryInfo`.

        Listing does not count as a use: the server's LRU order is left as it was.

        Returns
        -------
        list of EntryInfo
            One per entry; ``last_used`` from the server's idle time.
        """
        out = []
        now = time.time()
        names = list(
            self._call("list entries", lambda: list(self.client.scan_iter(match=f"{self.prefix}e:*", count=1000)))
        )
        for i in range(0, len(names), 256):
            batch = names[i : i + 256]
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # listing is not a use: LRU order stays
            for n in batch:
                pipe.object("idletime", n)
                pipe.hstrlen(n, "data")
                pipe.hmget(n, "tokens", "created")
                pipe.pttl(n)
            pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")
            replies = self._call("list entries", pipe.execute, raise_on_error=False)[1:-1]
            for j, n in enumerate(batch):
                idle, size, fields, pttl = replies[4 * j : 4 * j + 4]
                if isinstance(size, Exception) or isinstance(fields, Exception) or pttl == -2:
                    continue  # gone meanwhile, or not an entry
                tokens, created = fields
                key = (n.decode() if isinstance(n, bytes) else n)[len(self.prefix) + 2 :]
                created = _float(created, now)
                idle = idle if isinstance(idle, int) else 0
                out.append(
                    EntryInfo(
                        key=key,
                        nbytes=int(size),
                        tokens=_int(tokens),
                        created=created,
                        last_used=now - idle,
                        expires=None if not isinstance(pttl, int) or pttl < 0 else now + pttl / 1000,
                    )
                )
        return out

    def evict(self, max_bytes: int | None = None) -> list:
        """Remove least recently used entries until at most the budget is held (the server expires them).

        Parameters
        ----------
        max_bytes : int, optional
            The budget; default :attr:`max_bytes` (None: nothing is removed).

        Returns
        -------
        list of str
            Keys of the entries removed.
        """
        budget = self.max_bytes if max_bytes is None else check_limit("max_bytes", max_bytes)
        if budget is None:
            return []  # expiry is the server's; without a budget there is nothing to trim
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.nbytes for e in entries)
        dropped = []
        for e in entries:
            if total <= budget:
                break
            if self.delete(e.key):
                dropped.append(e.key)
            total -= e.nbytes
        return dropped

    # -- the server's own limits ------------------------------------------------------
    def set_memory_limit(self, max_bytes: int, policy: str = "allkeys-lru") -> None:
        """Make the server evict by size: ``CONFIG SET maxmemory`` and ``maxmemory-policy``.

        ``allkeys-lru`` drops the least recently used keys of the whole server (a server given
        to the store); ``volatile-lru`` only keys with a TTL (a store with ``ttl`` on a shared
        server).

        Parameters
        ----------
        max_bytes : int
            The server's ``maxmemory``, in bytes.
        policy : str, default "allkeys-lru"
            The server's ``maxmemory-policy``.
        """
        check_limit("max_bytes", max_bytes, allow_none=False)
        self._call("set its memory limit", self.client.config_set, "maxmemory-policy", policy)
        self._call("set its memory limit", self.client.config_set, "maxmemory", str(int(max_bytes)))


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default
