"""The server backend: entries in a Valkey or Redis server, or a Valkey Cluster, that any process or machine reaches.

One entry is one hash, ``{prefix}e:{<key>}``, with the fields ``data`` (the entry's bytes),
``nbytes`` (their declared length), ``sha256`` (their digest, hex), ``tokens`` and ``created``.
The braces are a hash tag: in a cluster, the slot (so the node) of an entry follows from its key
alone, whatever the prefix.

Writing: one server-side script deletes the key, sets every field and the TTL. The server runs
a script whole, with no other command in between, and the fields are set by one ``HSET``: a
writer that dies (or loses the server) before its command has arrived whole leaves nothing, and
no reader ever sees a hash with some fields set. Two writers of one key: one script runs after
the other, each entry whole. (A script, not ``MULTI``/``EXEC``: it touches one key, so it runs
the same on one server and on a cluster.)

Reading: one server-side script checks, atomically, that ``nbytes`` is a number no larger than
the reader's ``max_entry_bytes`` and equal to the length of ``data`` (``HSTRLEN``) and that
``sha256`` is 64 characters, and only then returns the fields: a server that behaves sends no
more than the declared, checked size. One that does not is bounded by the client's own reply
reader (:func:`connect`): a length over the limit, nesting deeper than a reply of this store
can be, a line without its end, a reply slower than the timeouts, anything that is not the
protocol, is a :class:`~arraykv.store.backend.StoreError` before anything of that size is
allocated. The digest is checked after the transfer; the bytes then go through the cache file
reader's own checks (:mod:`arraykv.store.entry`).

Use: this store's connections are ``CLIENT NO-TOUCH``: reading an entry is not a use (the
server's LRU clock of the key stays); :meth:`ValkeyStore.touch` (``TOUCH``) marks it, which a
reader does once the entry was accepted.

Eviction: by size on the server (``maxmemory`` with ``allkeys-lru`` or ``volatile-lru``:
:meth:`ValkeyStore.set_memory_limit`, or :class:`~arraykv.store.server.ValkeyServer`'s
``maxmemory``), which drops whole hashes; by time with a TTL on every entry (``ttl=``), which the
server enforces itself. :meth:`ValkeyStore.evict` also trims to a byte budget from the client,
least recently used first (``OBJECT IDLETIME``).

A cluster: ``redis+cluster://host:port,host:port`` (or ``valkey+cluster://``), a list of
``"host:port"`` nodes, or a ``valkey.cluster.ValkeyCluster``; the client library's cluster support
routes each key to its node and follows ``MOVED``/``ASK``.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from typing import Any

from .backend import DEFAULT_MAX_ENTRY_BYTES, EntryError, EntryInfo, StoreError, check_key, check_limit

__all__ = ["ValkeyStore", "connect", "DEFAULT_TIMEOUT", "DEFAULT_CONNECT_TIMEOUT", "CLUSTER_SCHEMES"]

#: Seconds a client waits for the server to send (or take) anything, and for a whole reply of
#: no bulk data (a reply with an entry gets :data:`MIN_RATE` on top).
DEFAULT_TIMEOUT = 5.0
#: Seconds a client waits for a connection to open.
DEFAULT_CONNECT_TIMEOUT = 2.0
#: The slowest transfer of an entry's bytes that is waited for, bytes per second (a reply of
#: ``n`` bytes may take ``timeout + n / MIN_RATE`` seconds in all).
MIN_RATE = 8 << 20
#: URL schemes of a cluster.
CLUSTER_SCHEMES = ("redis+cluster://", "valkey+cluster://")
# The deepest reply this store reads (cluster topology replies nest 4 deep), the most elements
# and the longest line (status, error, integer) one reply may hold.
_MAX_DEPTH = 8
_MAX_ELEMENTS = 1 << 22
_MAX_LINE = 1 << 16

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

# KEYS[1] the entry; ARGV: data, nbytes, sha256, tokens, created, ttl in ms (0: none). Reply 1.
_PUT_SCRIPT = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'data', ARGV[1], 'nbytes', ARGV[2], 'sha256', ARGV[3],
           'tokens', ARGV[4], 'created', ARGV[5])
if tonumber(ARGV[6]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[6]) end
return 1
"""


def connect(
    url: Any,
    *,
    max_reply_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    **kwargs: Any,
) -> Any:
    """A client for ``url``, with timeouts and a bounded reply reader, on one server or a cluster.

    Parameters
    ----------
    url : str or list of str
        ``redis://host:port/db``, ``rediss://``, ``unix:///path/to.sock``, a cluster URL
        (``redis+cluster://host:port,host:port``, also ``valkey+cluster://``) or a list of
        cluster nodes (``"host:port"`` or ``(host, port)``).
    max_reply_bytes : int, default 4 GiB
        The longest bulk string a reply may announce (more is refused before it is read).
    timeout : float, default 5.0
        Seconds to wait for the server to send or take anything (``socket_timeout``, on every
        transport), and for a whole reply without bulk data (:data:`MIN_RATE` on top for one
        with).
    connect_timeout : float, default 2.0
        Seconds to wait for a connection (``socket_connect_timeout``).
    **kwargs
        More options of the client (``valkey.Valkey`` / ``valkey.cluster.ValkeyCluster``).

    Returns
    -------
    valkey.Valkey or valkey.cluster.ValkeyCluster
        The client (the ``valkey`` package's; a cluster client connects at its first use).

    Raises
    ------
    ImportError
        The ``valkey`` client is not installed (``pip install "arraykv[store]"``).
    ValueError
        A cluster URL or node that is not ``host:port``.
    """
    try:
        import valkey
        from valkey.connection import Connection, SSLConnection, UnixDomainSocketConnection
    except ImportError:
        raise ImportError('the Valkey backend needs the valkey client: pip install "arraykv[store]"') from None
    limit = int(check_limit("max_reply_bytes", max_reply_bytes, allow_none=False))
    options = {
        "socket_timeout": float(check_limit("timeout", timeout, allow_none=False)),
        "socket_connect_timeout": float(check_limit("connect_timeout", connect_timeout, allow_none=False)),
        "retry": None,
        "retry_on_timeout": False,
        **kwargs,
    }
    if not isinstance(url, str) or url.startswith(CLUSTER_SCHEMES):
        nodes, auth = _cluster_nodes(url)
        from valkey.cluster import ClusterNode, ValkeyCluster

        options.pop("retry_on_timeout")
        options.setdefault("cluster_error_retry_attempts", 1)
        return _LazyCluster(
            lambda: ValkeyCluster(
                # a URL (the first node) makes the client give every node a connection pool of
                # this connection class; without one it passes connection_class to Valkey()
                url=f"redis://{nodes[0][0]}:{nodes[0][1]}",
                startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]],
                connection_class=_bounded_connection(Connection, limit),
                **auth,
                **options,
            ),
            nodes,
        )
    base = (
        UnixDomainSocketConnection
        if url.startswith("unix://")
        else SSLConnection
        if url.startswith(("rediss://", "valkeys://"))
        else Connection
    )
    return valkey.Valkey.from_url(url, connection_class=_bounded_connection(base, limit), **options)


def _cluster_nodes(spec: Any) -> tuple[list, dict]:
    """``([(host, port), ...], {username/password})`` of a cluster URL or node list."""
    from urllib.parse import unquote

    auth: dict = {}
    if isinstance(spec, str):
        rest = spec.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
        if "@" in rest:
            cred, rest = rest.rsplit("@", 1)
            user, _, password = cred.partition(":")
            auth = {k: unquote(v) for k, v in (("username", user), ("password", password)) if v}
        items: list = [n for n in rest.split(",") if n]
    elif isinstance(spec, (list, tuple)):
        items = list(spec)
    else:
        raise TypeError(f"a cluster is a URL or a list of host:port nodes, received {type(spec).__name__}")
    nodes = []
    for item in items:
        host: Any
        where: Any
        if isinstance(item, str):
            host, _, where = item.rpartition(":")
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            host, where = item
        else:
            host, where = "", ""
        try:
            port = int(where)
        except (TypeError, ValueError):
            port = -1
        if not host or not isinstance(host, str) or not 0 < port < 65536:
            raise ValueError(f"a cluster node must be host:port, received {item!r}")
        nodes.append((host.strip("[]"), port))
    if not nodes:
        raise ValueError(f"a cluster needs at least one node, received {spec!r}")
    return nodes, auth


class _LazyCluster:
    """A cluster client made at its first use, so that a cluster down when the store is made
    fails the first call (a ``StoreError`` there) instead of the store's construction."""

    def __init__(self, make: Callable[[], Any], nodes: list):
        self._make, self.nodes, self._client = make, nodes, None

    def __repr__(self) -> str:
        return f"ValkeyCluster({','.join(f'{h}:{p}' for h, p in self.nodes)})"

    def register_script(self, script: bytes) -> Any:
        """A script object that runs on this cluster (without connecting now)."""
        from valkey.commands.core import Script

        return Script(self, script)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_make", "nodes", "_client"):
            raise AttributeError(name)
        if self._client is None:
            self._client = self._make()
        return getattr(self._client, name)


@functools.cache
def _bounded_connection(base: type, limit: int) -> type:
    """``base`` (a ``valkey`` connection class) whose replies are read by :func:`_bounded_parser`
    and whose reads are not uses of the keys (``CLIENT NO-TOUCH``)."""
    from valkey.exceptions import ResponseError

    plain, cluster = _bounded_parser(limit, False), _bounded_parser(limit, True)

    class Bounded(base):
        def set_parser(self, parser_class: type) -> None:
            super().set_parser(cluster if "Cluster" in parser_class.__name__ else plain)

        def on_connect(self) -> None:
            super().on_connect()
            self.send_command("CLIENT", "NO-TOUCH", "ON")
            try:
                self.read_response()
            except ResponseError:  # a server without it (Redis < 7.2): reads count as uses there
                pass

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


@functools.cache
def _bounded_parser(limit: int, cluster: bool) -> type:
    """A RESP2 reply reader that refuses, before reading it, what no reply of this store is."""
    from valkey._parsers.resp2 import _RESP2Parser
    from valkey._parsers.socket import SENTINEL, SYM_CRLF, SocketBuffer
    from valkey.exceptions import ConnectionError, InvalidResponse, TimeoutError

    class Buffer(SocketBuffer):
        deadline: float | None = None

        def _read_from_socket(self, length: Any = None, timeout: Any = SENTINEL, raise_on_timeout: Any = True) -> bool:
            if timeout is not SENTINEL or self.deadline is None:
                return bool(super()._read_from_socket(length, timeout, raise_on_timeout))
            need, got = length or 1, 0
            while got < need:  # one recv at a time, each bounded by what is left of the deadline
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the server's reply took longer than its deadline")
                wait = left if self.socket_timeout is None else min(float(self.socket_timeout), left)
                before = self._end()
                super()._read_from_socket(None, wait, True)
                got += self._end() - before
            return True

        def _end(self) -> int:
            pos = self._buffer.tell()
            end = self._buffer.seek(0, 2)
            self._buffer.seek(pos)
            return int(end)

        def readline(self) -> bytes:
            data = self._buffer.readline()
            while not data.endswith(SYM_CRLF):
                if len(data) > _MAX_LINE:
                    raise InvalidResponse(f"a reply line longer than {_MAX_LINE} bytes")
                self._read_from_socket()
                data += self._buffer.readline()
            return bytes(data[:-2])

    base: type = _RESP2Parser
    if cluster:
        from valkey.cluster import ClusterParser

        exceptions = ClusterParser.EXCEPTION_CLASSES
    else:
        exceptions = _RESP2Parser.EXCEPTION_CLASSES

    class Parser(base):
        EXCEPTION_CLASSES = exceptions

        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)
            self._buffer = Buffer(self._sock, self.socket_read_size, connection.socket_timeout)

        def read_response(self, disable_decoding: bool = False) -> Any:
            buf = self._buffer
            if buf is None:
                raise ConnectionError("the connection is closed")
            buf.deadline = time.monotonic() + float(buf.socket_timeout or DEFAULT_TIMEOUT)
            self._elements = 0
            try:
                return super().read_response(disable_decoding=disable_decoding)
            finally:
                if self._buffer is not None:
                    self._buffer.deadline = None

        def _read_response(self, disable_decoding: bool = False, depth: int = 0) -> Any:
            raw = self._buffer.readline()
            if not raw:
                raise ConnectionError("Connection closed by server.")
            byte, rest = raw[:1], raw[1:]
            self._elements += 1
            if self._elements > _MAX_ELEMENTS:
                raise InvalidResponse(f"a reply of more than {_MAX_ELEMENTS} elements")
            if byte == b"-":
                error = self.parse_error(rest.decode("utf-8", errors="replace"))
                if isinstance(error, ConnectionError):
                    raise error
                return error
            if byte == b"+":
                return rest
            if byte not in (b":", b"$", b"*"):
                raise InvalidResponse(f"not a reply of the protocol: {raw[:60]!r}")
            n = _number(rest)
            if n is None:
                raise InvalidResponse(f"not a number in the reply: {raw[:60]!r}")
            if byte == b":":
                return n
            if n == -1:
                return None
            if n < 0:
                raise InvalidResponse(f"a negative length in the reply: {raw[:60]!r}")
            if byte == b"$":
                if n > limit:
                    raise InvalidResponse(f"a reply of {n} bytes, more than the limit of {limit}")
                self._buffer.deadline = (self._buffer.deadline or time.monotonic()) + n / MIN_RATE
                data = self._buffer.read(n)
                if len(data) != n:
                    raise InvalidResponse("a bulk reply shorter than its length")
                return data
            if depth >= _MAX_DEPTH:
                raise InvalidResponse(f"a reply nested deeper than {_MAX_DEPTH}")
            if n > _MAX_ELEMENTS - self._elements:
                raise InvalidResponse(f"a reply of {n} elements, more than {_MAX_ELEMENTS}")
            return [self._read_response(disable_decoding, depth + 1) for _ in range(n)]

    Parser.__name__ = Parser.__qualname__ = "BoundedClusterParser" if cluster else "BoundedParser"
    return Parser


def _number(text: bytes) -> int | None:
    """The integer of a reply line, None unless it is one (at most 20 digits and a sign)."""
    if not 0 < len(text) <= 21:
        return None
    body = text[1:] if text[:1] == b"-" else text
    if not body.isdigit():
        return None
    return int(text)


class ValkeyStore:
    """Entries in a Valkey/Redis server, or a Valkey Cluster.

    Parameters
    ----------
    client : str, list of str or client object
        A URL (``redis://127.0.0.1:6379/0``, ``unix:///path/to.sock``, a cluster's
        ``redis+cluster://host:port,host:port``), a list of cluster nodes (``"host:port"``),
        all opened by :func:`connect` with this store's limits; or a ``valkey.Valkey`` /
        ``valkey.cluster.ValkeyCluster`` / ``redis.Redis`` client, used as it is (its own
        timeouts and reply reader: :func:`connect` makes one with this store's).
    prefix : str, default "arraykv:"
        Prefix of every key this store writes (several stores can share a server).
    ttl : float, optional
        Seconds each entry lives (set on write; the server removes it). None: no expiry.
    max_bytes : int, optional
        Budget :meth:`evict` trims to when not given one. The server's own ``maxmemory``
        (:meth:`set_memory_limit`) is what bounds it between calls.
    max_entry_bytes : int, default 4 GiB
        Larger entries are refused (on the server, before any byte is sent) by ``get``, and by
        ``put``; a reply announcing more is refused by the client before it is read.
    timeout : float, default 5.0
        Seconds to wait for the server (:func:`connect`).
    connect_timeout : float, default 2.0
        Seconds to wait for a connection (:func:`connect`).

    Attributes
    ----------
    client : valkey.Valkey or valkey.cluster.ValkeyCluster
        The client.
    cluster : bool
        Whether the client is a cluster's.
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "arraykv:",
        ttl: float | None = None,
        max_bytes: int | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ):
        if not isinstance(prefix, str) or not prefix or any(c.isspace() or c in "*?[]{}" for c in prefix):
            raise ValueError(
                f"prefix must be a non-empty string without spaces, glob characters or braces, received {prefix!r}"
            )
        self.ttl = check_limit("ttl", ttl)
        self.max_bytes = check_limit("max_bytes", max_bytes)
        self.max_entry_bytes = int(check_limit("max_entry_bytes", max_entry_bytes, allow_none=False))
        self._own = isinstance(client, (str, list, tuple))  # ours: its connections are NO-TOUCH
        if self._own:
            client = connect(
                client,
                max_reply_bytes=self.max_entry_bytes + (1 << 16),
                timeout=timeout,
                connect_timeout=connect_timeout,
            )
        self.client = client
        self.cluster = isinstance(client, _LazyCluster) or callable(getattr(client, "get_primaries", None))
        self.prefix = prefix
        self._get = self.client.register_script(_GET_SCRIPT.encode())
        self._put = self.client.register_script(_PUT_SCRIPT.encode())

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
            ``<prefix>e:{<key>}`` (the braces: a cluster places it by the key alone).
        """
        return f"{self.prefix}e:{{{check_key(key)}}}"

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; whatever it raises (the client's errors, a reply it cannot
        parse, a timeout) becomes a StoreError."""
        try:
            return fn(*args, **kwargs)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - a server may answer anything
            raise StoreError(f"the server could not {what}: {type(exc).__name__}: {str(exc)[:300]}") from None

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
            The entry's bytes; None when the server holds none (or it expired). Reading is not
            a use (:meth:`touch` is).

        Raises
        ------
        EntryError
            The server refused the entry (its size or fields), or its bytes do not match its digest.
        StoreError
            The server failed, or answered something that is not a reply of the read script.
        """
        name = self.name_of(key)
        reply = self._call("read an entry", self._get, keys=[name], args=[self.max_entry_bytes])
        if reply is None:
            return None
        if not isinstance(reply, list) or not reply or isinstance(reply[0], bool) or not isinstance(reply[0], int):
            raise StoreError(f"entry {key[:16]}...: the server answered {_shape(reply)}, not an entry")
        if reply[0] == -1 and len(reply) == 2 and isinstance(reply[1], bytes):
            raise EntryError(f"entry {key[:16]}... refused: {reply[1][:200].decode(errors='replace')}")
        if (
            reply[0] != 0
            or len(reply) != 4
            or not all(isinstance(r, bytes) for r in reply[1:])
            or len(reply[1]) > self.max_entry_bytes
            or len(reply[2]) != 64
        ):
            raise StoreError(f"entry {key[:16]}...: the server answered {_shape(reply)}, not an entry")
        data: bytes = reply[1]
        if hashlib.sha256(data).hexdigest().encode() != reply[2]:
            raise EntryError(f"entry {key[:16]}... is corrupted (its bytes do not match its sha256)")
        return data

    def put(self, key: str, data: bytes, *, tokens: int | None = None) -> None:
        """Store ``data`` with its size, SHA-256, ``tokens`` and time in one script (``ttl`` set).

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
        view = memoryview(data).cast("B")
        if view.nbytes > self.max_entry_bytes:
            raise EntryError(f"an entry of {view.nbytes} bytes is more than max_entry_bytes={self.max_entry_bytes}")
        args = [
            view,
            str(view.nbytes),
            hashlib.sha256(view).hexdigest(),
            "" if tokens is None else str(int(tokens)),
            repr(time.time()),
            "0" if self.ttl is None else str(max(1, int(self.ttl * 1000))),
        ]
        reply = self._call("store an entry", self._put, keys=[name], args=args)
        if reply != 1:
            raise StoreError(f"the server answered {_shape(reply)} to a write, not 1")

    def touch(self, key: str) -> bool:
        """Mark ``key``'s entry as used now (``TOUCH``: the server's LRU clock); whether there was one.

        Parameters
        ----------
        key : str
            The entry's key: 16-128 lower-case hexadecimal digits.

        Returns
        -------
        bool
            True when the entry was held.
        """
        return _count(self._call("mark an entry as used", self.client.touch, self.name_of(key)), "TOUCH") > 0

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
        return _count(self._call("look an entry up", self.client.exists, self.name_of(key)), "EXISTS") > 0

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
        return _count(self._call("delete an entry", self.client.delete, self.name_of(key)), "DEL") > 0

    def entries(self) -> list:
        """Every entry under :attr:`prefix`, as :class:`~arraykv.store.backend.EntryInfo` (on every
        primary of a cluster).

        Listing does not count as a use: the server's LRU order is left as it was.

        Returns
        -------
        list of EntryInfo
            One per entry; ``last_used`` from the server's idle time.
        """
        if not self.cluster:
            return self._entries_on(self.client)
        nodes = self._call("list the cluster's nodes", self.client.get_primaries)
        out = []
        for node in nodes:
            out += self._entries_on(self._call("reach a node", self.client.get_valkey_connection, node))
        return out

    def _entries_on(self, client: Any) -> list:
        """:meth:`entries` of one server (a cluster's node: its own client)."""
        out = []
        now = time.time()
        names = self._call("list entries", lambda: list(client.scan_iter(match=f"{self.prefix}e:*", count=1000)))
        for i in range(0, len(names), 256):
            batch = names[i : i + 256]
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # listing is not a use: LRU order stays
            for n in batch:
                pipe.object("idletime", n)
                pipe.hstrlen(n, "data")
                pipe.hmget(n, "tokens", "created")
                pipe.pttl(n)
            if not self._own:  # a client of the caller's is left as it was
                pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")
            replies = self._call("list entries", pipe.execute, raise_on_error=False)[1 : 1 + 4 * len(batch)]
            for j, n in enumerate(batch):
                idle, size, fields, pttl = replies[4 * j : 4 * j + 4]
                if not isinstance(size, int) or not isinstance(fields, list) or len(fields) != 2 or pttl == -2:
                    continue  # gone meanwhile, or not an entry
                tokens, created = fields
                key = (n.decode(errors="replace") if isinstance(n, bytes) else str(n))[len(self.prefix) + 2 :]
                key = key.strip("{}")
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


def _count(reply: Any, command: str) -> int:
    """An integer reply of ``command``, or a StoreError naming what came instead."""
    if isinstance(reply, bool) or not isinstance(reply, int):
        raise StoreError(f"the server answered {_shape(reply)} to {command}, not an integer")
    return reply


def _shape(reply: Any, depth: int = 0) -> str:
    """A short description of a reply's type and shape, for messages."""
    if isinstance(reply, list):
        inner = ", ".join(_shape(r, depth + 1) for r in reply[:4]) if depth < 2 else "..."
        return f"a list of {len(reply)} [{inner}{', ...' if len(reply) > 4 else ''}]"
    if isinstance(reply, (bytes, str)):
        return f"{type(reply).__name__} of length {len(reply)}"
    return type(reply).__name__


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
