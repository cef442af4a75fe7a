"""Stores that misbehave: generation finishes with a warning and the logits of a run without a store.

Real misbehaving media, no mocks: a RESP server written here (socketserver on 127.0.0.1) that
answers garbage of many shapes, lengths it never sends, nothing at all, or half a reply; a real
Valkey server stopped with SIGSTOP; a unix socket that nobody serves or nobody answers; folder
stores with a FIFO, a folder, a loop of links, a socket, a device, a sparse giant file or a file
where a subfolder should be at the entries' paths, and a file system that is full. Each run goes
through :class:`PrefixStore`: with ``on_error="warn"`` it finishes within 20 s with a
StoreWarning and logits equal to those of the same schedule without a store; with
``on_error="raise"`` it raises StoreError.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import socketserver
import stat
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from arraykv.store import (
    EntryError,
    LocalStore,
    PrefixStore,
    StoreError,
    StoreWarning,
    ValkeyServer,
    ValkeyStore,
    segmented_prefill,
)
from arraykv.store.backend import GuardedBackend

from tiny_models import store_prompt

S, CHUNK = 64, 32  # tokens per stored segment, the decoder's prefill chunk within a segment
N = 3 * S + 10  # three stored boundaries: several lookups and writes per prompt
LIMIT_S = 20.0  # what a prompt may take whatever the store does


@pytest.fixture(scope="module")
def want(model):
    """The logits of the schedule without a store."""
    return segmented_prefill(model, store_prompt(N), model.make_cache("pqo4"), chunk_tokens=S, chunk_size=CHUNK)


def through(model, backend, *, on_error: str = "warn"):
    """Prefill the prompt through a PrefixStore over ``backend``: (logits, warnings, seconds)."""
    store = PrefixStore(backend, chunk_tokens=S, policy="every", on_error=on_error)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = store.prefill(model, store_prompt(N), model.make_cache("pqo4"), chunk_size=CHUNK)
    return logits, [w for w in caught if issubclass(w.category, StoreWarning)], time.monotonic() - t0


def assert_survived(model, want, backend, *, note: str = "") -> list:
    """Warn mode: a warning, the logits of no store, within the limit; returns the warnings' texts."""
    logits, caught, took = through(model, backend)
    assert took < LIMIT_S, f"{note}: took {took:.1f} s"
    assert caught, f"{note}: no StoreWarning"
    assert np.array_equal(logits, want), note
    return [str(w.message) for w in caught]


def assert_raises(model, backend, *, note: str = "") -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreError):
        through(model, backend, on_error="raise")
    assert time.monotonic() - t0 < LIMIT_S, note


# -- a server that speaks garbage -----------------------------------------------------------


class Misbehaving(socketserver.ThreadingTCPServer):
    """A TCP server on 127.0.0.1 that answers every read with ``behave(conn, data)``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behave):
        self.behave = behave
        self.stopping = threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server_address[1]}/0"

    def close(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        conn = self.request
        conn.settimeout(0.5)
        while not self.server.stopping.is_set():
            try:
                data = conn.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                if self.server.behave(conn, data, self.server.stopping) is False:
                    return
            except OSError:
                return


def answer(reply: bytes):
    """Every command gets ``reply``."""

    def behave(conn, data, stopping):
        conn.sendall(reply)

    return behave


def never_answers(conn, data, stopping):
    stopping.wait(60)


def half_then_close(conn, data, stopping):
    conn.sendall(b"*4\r\n:0\r\n$100\r\nabc")
    return False


def trickle(conn, data, stopping):
    """One byte of a line that never ends every 0.2 s: no single read ever times out."""
    conn.sendall(b"+")
    while not stopping.wait(0.2):
        conn.sendall(b"x")


def huge_bulk(conn, data, stopping):
    """Announce 100 MiB and send them (the client's limit is 1 MiB)."""
    conn.sendall(b"$104857600\r\n")
    block = b"\0" * (1 << 20)
    for _ in range(100):
        if stopping.is_set():
            return False
        conn.sendall(block)
    conn.sendall(b"\r\n")


GARBAGE = {
    "not-resp": answer(b"hello there\r\n"),
    "int-not-a-number": answer(b":12ab\r\n"),
    "length-not-a-number": answer(b"$1x\r\nx\r\n"),
    "negative-length": answer(b"$-7\r\n"),
    "negative-array": answer(b"*-3\r\n"),
    "deeply-nested": answer(b"*1\r\n" * 200_000 + b":1\r\n"),
    "huge-array": answer(b"*4000000000\r\n"),
    "huge-bulk-length": answer(b"$99999999999999\r\n"),
    "long-number": answer(b":" + b"9" * 5000 + b"\r\n"),
    "line-without-end": answer(b"+" + b"y" * (2 << 20)),
    "empty-array": answer(b"*0\r\n"),
    "array-of-wrong-types": answer(b"*4\r\n:0\r\n:1\r\n*0\r\n$-1\r\n"),
    "array-of-ints": answer(b"*2\r\n:5\r\n:6\r\n"),
    "status-ok": answer(b"+OK\r\n"),
    "error": answer(b"-ERR no\r\n"),
    "nil": answer(b"$-1\r\n"),
    "bulk": answer(b"$3\r\nabc\r\n"),
    "zero-with-short-digest": answer(b"*4\r\n:0\r\n$8\r\nARRAYKV\x00\r\n$3\r\nabc\r\n$0\r\n\r\n"),
    "bool-and-double": answer(b"#t\r\n,1.5\r\n"),
    "binary": answer(bytes(range(256)) * 16),
    "moved": answer(b"-MOVED 3999 127.0.0.1:1\r\n"),
    "half-then-close": half_then_close,
    "closes-at-once": lambda conn, data, stopping: False,
    "trickle": trickle,
    "huge-bulk": huge_bulk,
    "never-answers": never_answers,
}


@pytest.mark.parametrize("shape", sorted(GARBAGE))
def test_a_server_answering_garbage_is_a_warning(model, want, shape):
    server = Misbehaving(GARBAGE[shape])
    try:
        backend = ValkeyStore(server.url, timeout=1.0, connect_timeout=1.0, max_entry_bytes=1 << 20)
        assert_survived(model, want, backend, note=shape)
        backend = ValkeyStore(server.url, timeout=1.0, connect_timeout=1.0, max_entry_bytes=1 << 20)
        assert_raises(model, backend, note=shape)
    finally:
        server.close()


def test_a_reply_over_the_limit_is_refused_before_it_is_read():
    """100 MiB announced to a reader of 1 MiB: refused at the length, not read (the process does
    not grow by the reply)."""
    server = Misbehaving(huge_bulk)
    try:
        backend = ValkeyStore(server.url, timeout=2.0, max_entry_bytes=1 << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(StoreError, match="more than the limit"):
            backend.get("ab" * 16)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        assert grown < 32 << 20
    finally:
        server.close()


def test_a_silent_server_costs_one_timeout_with_the_default_timeouts(model, want):
    """No timeout given: the defaults bound every wait, and the circuit breaker skips the store
    after the first, so a prompt of several lookups and writes costs one timeout."""
    server = Misbehaving(never_answers)
    try:
        texts = assert_survived(model, want, ValkeyStore(server.url), note="never answers")
        assert any("skipped" in t for t in texts)  # the later calls did not wait
    finally:
        server.close()


# -- a real server that stops answering -------------------------------------------------------


def test_a_stopped_valkey_server_costs_one_timeout_not_one_per_call(model, want):
    with ValkeyServer() as server:
        backend = ValkeyStore(server.url)
        backend.put("ab" * 16, b"ARRAYKV\0warm")  # connected, then the process stops answering
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            logits, caught, took = through(model, backend)
            assert np.array_equal(logits, want) and caught
            assert took < LIMIT_S  # the default 5 s timeout, then the breaker (before: 51-91 s)
            assert_raises(model, ValkeyStore(server.url, timeout=1.0), note="stopped server")
        finally:
            os.kill(server.process.pid, signal.SIGCONT)


def test_a_unix_socket_nobody_serves(model, want, tmp_path):
    assert_survived(model, want, f"unix://{tmp_path}/none.sock", note="no socket")
    assert_raises(model, ValkeyStore(f"unix://{tmp_path}/none.sock"), note="no socket")


def test_a_unix_socket_nobody_answers_times_out(model, want, tmp_path):
    """A listening unix socket whose server never reads: before, no timeout at all over unix://."""
    path = str(tmp_path / "silent.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    try:
        assert_survived(model, want, ValkeyStore(f"unix://{path}", timeout=1.0), note="silent unix socket")
        assert_raises(model, ValkeyStore(f"unix://{path}", timeout=1.0), note="silent unix socket")
    finally:
        sock.close()


def test_a_killed_server_mid_prompt(model, want):
    """The server dies after the first segment was stored: the prompt still computes exactly."""
    server = ValkeyServer().start()
    try:
        backend = ValkeyStore(server.url)
        store = PrefixStore(backend, chunk_tokens=S, policy="every")
        cache = model.make_cache("pqo4")
        killed = []

        def run(seg):
            out = model.prefill(seg, cache, chunk_size=CHUNK, logits="last", prompt_store="exact")
            if not killed:
                server.kill()
                killed.append(True)
            return out

        ids = store_prompt(N)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = store.prefill_segments(run, ids, cache, store.keys(model, cache, ids, chunk_size=CHUNK))
        assert np.array_equal(got, want)
        assert any(issubclass(w.category, StoreWarning) for w in caught)
    finally:
        server.stop()


# -- the circuit breaker ---------------------------------------------------------------------


class Flaky:
    """A backend whose calls fail while ``down`` (a real one underneath)."""

    def __init__(self, inner):
        self.inner, self.down, self.calls = inner, True, 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise ConnectionResetError("the medium went away")
            return method(*args, **kwargs)

        return call


def test_the_circuit_breaker_skips_then_probes_then_closes(tmp_path):
    now = [0.0]
    flaky = Flaky(LocalStore(tmp_path))
    guard = GuardedBackend(flaky, backoff=1.0, max_backoff=4.0, clock=lambda: now[0])
    with pytest.raises(StoreError, match="ConnectionResetError"):
        guard.contains("ab" * 16)
    assert flaky.calls == 1 and guard.open_for == 1.0
    for _ in range(5):  # skipped: the backend is not called while the circuit is open
        with pytest.raises(StoreError, match="skipped"):
            guard.get("ab" * 16)
    assert flaky.calls == 1
    now[0] = 1.5  # a probe; it fails: open twice as long
    with pytest.raises(StoreError, match="ConnectionResetError"):
        guard.get("ab" * 16)
    assert flaky.calls == 2 and guard.open_for == 2.0
    now[0] = 10.0
    flaky.down = False  # the probe succeeds: closed again
    assert guard.get("ab" * 16) is None and guard.failures == 0 and guard.open_for == 0.0
    guard.put("ab" * 16, b"ARRAYKV\0x")
    assert guard.get("ab" * 16) == b"ARRAYKV\0x"


def test_the_breaker_lets_entry_refusals_through_and_checks_arguments(tmp_path):
    guard = GuardedBackend(LocalStore(tmp_path, max_entry_bytes=16))
    with pytest.raises(EntryError):
        guard.put("ab" * 16, b"ARRAYKV\0" + b"x" * 100)
    assert guard.failures == 0  # an entry refused says nothing of the backend
    with pytest.raises(ValueError, match="hexadecimal"):
        guard.get("../x")
    with pytest.raises(TypeError, match="bytes"):
        guard.put("ab" * 16, "text")
    with pytest.raises(TypeError, match="guarded already"):
        GuardedBackend(guard)
    for bad in ({"backoff": 0}, {"max_backoff": -1}, {"backoff": 5.0, "max_backoff": 1.0}):
        with pytest.raises(ValueError):
            GuardedBackend(LocalStore(tmp_path), **bad)


def test_a_backend_raising_anything_is_a_store_error(model, want, tmp_path):
    """A backend of the caller's that raises what it likes (IndexError, RecursionError, ...)."""

    class Broken:
        def __init__(self, exc):
            self.exc = exc

        def get(self, *args, **kwargs):
            raise self.exc

        put = contains = delete = touch = entries = evict = get

    for exc in (IndexError("i"), AttributeError("a"), RecursionError("r"), ValueError("v"), MemoryError()):
        assert_survived(model, want, Broken(exc), note=type(exc).__name__)
        assert_raises(model, Broken(exc), note=type(exc).__name__)


# -- folder stores with something else at the entries' paths --------------------------------


def _plant(store: LocalStore, keys: list, make) -> None:
    for key in keys:
        path = store.path_of(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        make(path)


def _fifo(path):
    os.mkfifo(path)


def _folder(path):
    os.makedirs(path)


def _link_loop(path):
    os.symlink(os.path.basename(path), path)


def _link_to_dev_zero(path):
    os.symlink("/dev/zero", path)


def _socket(path):
    here = os.getcwd()
    os.chdir(os.path.dirname(path))  # the full path is longer than a socket address may be
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(os.path.basename(path))
    finally:
        os.chdir(here)


def _sparse_giant(path):
    with open(path, "wb") as f:
        f.truncate(512 << 20)


def _garbage_file(path):
    with open(path, "wb") as f:
        f.write(os.urandom(4096))


FOLDER_FAULTS = {
    "fifo": _fifo,
    "folder": _folder,
    "link-loop": _link_loop,
    "link-to-dev-zero": _link_to_dev_zero,
    "socket": _socket,
    "sparse-512MiB": _sparse_giant,
    "garbage": _garbage_file,
}


def _keys(model, store: PrefixStore) -> list:
    cache = model.make_cache("pqo4")
    return store.keys(model, cache, store_prompt(N), chunk_size=CHUNK)


@pytest.mark.parametrize("fault", sorted(FOLDER_FAULTS))
def test_something_else_at_an_entry_path_is_a_warning(model, want, tmp_path, fault):
    local = LocalStore(tmp_path / "store")
    keys = _keys(model, PrefixStore(local, chunk_tokens=S, policy="every"))
    _plant(local, keys, FOLDER_FAULTS[fault])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert_survived(model, want, local, note=fault)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 64 << 20  # nothing giant read
    for key in keys:  # still there, or replaced by a whole entry
        st = os.lstat(local.path_of(key))
        if stat.S_ISREG(st.st_mode) and fault not in ("sparse-512MiB", "garbage"):
            with open(local.path_of(key), "rb") as f:
                assert f.read(8) in (b"ARRAYKV\0", b"AKVENTRY")
    local2 = LocalStore(tmp_path / "store2")
    _plant(local2, keys, FOLDER_FAULTS[fault])
    if fault not in ("sparse-512MiB", "garbage"):  # those are entries refused (EntryError), not faults
        assert_raises(model, local2, note=fault)
    local.entries(), local.evict(), local2.entries()  # listing and evicting step over them


def test_a_device_at_an_entry_path(model, want, tmp_path):
    local = LocalStore(tmp_path / "store")
    keys = _keys(model, PrefixStore(local, chunk_tokens=S))

    def device(path):
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers

    try:
        _plant(local, keys, device)
    except PermissionError:
        pytest.skip("creating a device node needs privileges")
    assert_survived(model, want, local, note="device")


def test_a_file_where_a_subfolder_should_be(model, want, tmp_path):
    local = LocalStore(tmp_path / "store")
    keys = _keys(model, PrefixStore(local, chunk_tokens=S, policy="every"))
    for key in keys:
        sub = os.path.dirname(local.path_of(key))
        shutil.rmtree(sub, ignore_errors=True)
        with open(sub, "wb") as f:
            f.write(b"not a folder")
    assert_survived(model, want, local, note="file as subfolder")
    assert_raises(model, local, note="file as subfolder")
    assert local.entries() == [] and local.evict() == []


def test_a_store_folder_that_is_a_file(model, want, tmp_path):
    """The folder given is a file: the store is made, every use warns (before: the constructor
    raised out of generate)."""
    where = tmp_path / "store"
    where.write_bytes(b"a file")
    assert_survived(model, want, str(where), note="folder is a file")
    assert_raises(model, str(where), note="folder is a file")
    out = model.generate(store_prompt(N), max_new_tokens=2, store=str(where))
    assert len(out) >= 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_entry_file(model, want, tmp_path):
    local = LocalStore(tmp_path / "store")
    keys = _keys(model, PrefixStore(local, chunk_tokens=S, policy="every"))

    def unreadable(path):
        with open(path, "wb") as f:
            f.write(b"ARRAYKV\0")
        os.chmod(path, 0)

    _plant(local, keys, unreadable)
    assert_survived(model, want, local, note="unreadable")


def test_a_full_file_system(model, want, tmp_path):
    """A folder store on a 64 KiB tmpfs: every write fails with ENOSPC (needs mount rights)."""
    where = tmp_path / "full"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs privileges")
    try:
        texts = assert_survived(model, want, LocalStore(where), note="ENOSPC")
        assert any("No space left" in t for t in texts)
        assert_raises(model, LocalStore(where), note="ENOSPC")
    finally:
        subprocess.run(["umount", str(where)], check=False)


FULL_SHM = r"""
import sys, warnings
import numpy as np
sys.path.insert(0, sys.argv[2])
from tiny_models import store_model
from arraykv.store import LocalStore, PrefixStore, StoreWarning, segmented_prefill
model = store_model()
ids = np.random.default_rng(0).integers(0, 101, 3 * 64 + 10).tolist()
want = segmented_prefill(model, ids, model.make_cache("pqo4"), chunk_tokens=64, chunk_size=32)
store = PrefixStore(LocalStore(sys.argv[1]), chunk_tokens=64, policy="every")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=32)
assert np.array_equal(got, want)
assert store.last_report.stored == [64, 128, 192], (store.last_report, [str(w.message) for w in caught])
print("ok")
"""


def test_entries_are_encoded_without_dev_shm(tmp_path):
    """/dev/shm full (a 4 KiB tmpfs over it, in a mount namespace of its own): entries are still
    encoded and stored (before, the scratch file there raised ENOSPC out of generation)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    script = tmp_path / "full_shm.py"
    script.write_text(FULL_SHM)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where tiny_models is
    shell = (
        "mount -t tmpfs -o size=4k tmpfs /dev/shm && (head -c 1M /dev/zero > /dev/shm/fill || true) && "
        f'exec "{sys.executable}" "{script}" "{tmp_path / "store"}" "{tests}"'
    )
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True)
    if probe.returncode:
        pytest.skip("a mount namespace needs privileges")
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("method", ["pqo4", "dense"])
def test_a_restore_allocates_the_entry_about_once(method):
    """Peak traced memory of restore_entry at most 1.5x the entry (before: 3x, and the entry again
    in an anonymous file): the entry is parsed in place, and the cache's restore copies it once."""
    import tracemalloc

    from arraykv import make_cache
    from arraykv.store import encode_cache, restore_entry

    rng = np.random.default_rng(0)
    kw = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 64}
    src = make_cache(method, **kw)
    for layer in range(4):
        k = rng.standard_normal((1, 4, 1024, 64)).astype(np.float32)
        src.append(layer, k, 0.5 * k, rng.standard_normal((1, 8, 1024, 64)).astype(np.float32))
    data = bytes(encode_cache(src, rollback_copies=False))
    dst = make_cache(method, **kw)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        restore_entry(dst, data, tokens=1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (peak - base) / len(data) <= 1.5
    assert encode_cache(dst, rollback_copies=False) == encode_cache(src, rollback_copies=False)
    blank = bytearray(data)
    again = make_cache(method, **kw)
    restore_entry(again, blank, tokens=1024)
    blank[64:] = bytes(len(blank) - 64)  # the restored cache shares nothing with the entry's bytes
    assert encode_cache(again, rollback_copies=False) == encode_cache(src, rollback_copies=False)
