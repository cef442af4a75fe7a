"""Several processes on one store: concurrent writers and readers, writers and servers that die."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from arraykv.store import LocalStore, PrefixStore, ValkeyServer, ValkeyStore, segmented_prefill

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_worker.py")
KEYS = [f"{i:02x}" * 16 for i in range(4)]


def worker(*args: object, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def spec_of(backend) -> tuple:
    if isinstance(backend, LocalStore):
        return backend.root, "-"
    return _url(backend), backend.prefix


def _url(store: ValkeyStore) -> str:
    kw = store.client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


def whole(data: bytes) -> bool:
    import hashlib

    return hashlib.sha256(data[40:]).digest() == data[8:40]


def test_four_processes_writing_and_reading_one_store_never_see_a_torn_entry(backend):
    spec, prefix = spec_of(backend)
    procs = [worker("hammer", spec, prefix, seed, 40, 200_000) for seed in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        reads, torn = map(int, out.split())
        assert torn == 0
    assert sum(int(o.split()[0]) for o, _ in outs) > 0
    for key in KEYS:
        data = backend.get(key)
        assert data is None or whole(data)


def test_a_writer_killed_mid_write_leaves_no_torn_entry(backend):
    spec, prefix = spec_of(backend)
    for delay in (0.1, 0.4):
        p = worker("writeloop", spec, prefix, 8_000_000)
        assert p.stdout.readline().strip() == "started"
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        for key in KEYS:
            data = backend.get(key)
            assert data is None or whole(data)
    for e in backend.entries():
        assert whole(backend.get(e.key))


def _send(port: int, *parts: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    for part in parts:
        s.sendall(part)
    return s


def _resp(*args: bytes) -> bytes:
    out = b"*%d\r\n" % len(args)
    for a in args:
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return out


def test_a_write_cut_off_before_exec_or_inside_the_data_leaves_nothing(valkey_server, valkey_store):
    """A writer's connection closes in the middle of the transaction (after half the data, or
    with every command sent but EXEC): the server applies nothing."""
    name = valkey_store.name_of(KEYS[0]).encode()
    data = b"x" * 1_000_000
    hset = _resp(b"HSET", name, b"data", data, b"nbytes", b"%d" % len(data), b"sha256", b"0" * 64)
    port = valkey_server.port
    for cut in (hset[: len(hset) // 2], hset):  # inside the data; the whole HSET but no EXEC
        s = _send(port, _resp(b"MULTI"), _resp(b"DEL", name), cut)
        time.sleep(0.1)
        s.close()
        time.sleep(0.1)
        assert valkey_store.client.exists(name) == 0
        assert valkey_store.get(KEYS[0]) is None


def test_a_server_killed_mid_write_keeps_only_whole_entries(tmp_path):
    """A server logging every write (appendonly, fsync always) is killed while a writer sends an
    entry; restarted on the same folder it holds the entries it acknowledged, whole, and not
    the one cut off."""
    folder = str(tmp_path / "server")
    os.makedirs(folder)
    server = ValkeyServer(directory=folder, appendonly=True).start()
    store = ValkeyStore(server.url)
    import hashlib

    body = hashlib.shake_128(b"done").digest(300_000)
    done = hashlib.sha256(body).digest() + body
    store.put(KEYS[0], done, tokens=64)
    name = store.name_of(KEYS[1]).encode()
    big = b"y" * 4_000_000
    hset = _resp(b"HSET", name, b"data", big, b"nbytes", b"%d" % len(big), b"sha256", b"0" * 64)
    s = _send(server.port, _resp(b"MULTI"), _resp(b"DEL", name), hset[: len(hset) // 2])
    time.sleep(0.1)
    server.kill()
    s.close()
    writer_error = None
    try:
        store.put(KEYS[2], done)
    except Exception as exc:  # noqa: BLE001 - the error a writer sees is part of what is checked
        writer_error = exc
    from arraykv.store import StoreError

    assert isinstance(writer_error, StoreError) and "could not store" in str(writer_error)
    again = ValkeyServer(directory=folder, appendonly=True, port=server.port).start()
    try:
        store = ValkeyStore(again.url)
        assert store.get(KEYS[0]) == done
        assert store.get(KEYS[1]) is None and store.get(KEYS[2]) is None
        assert [e.key for e in store.entries()] == [KEYS[0]]
    finally:
        again.stop()
        server.stop()


def test_a_crafted_server_entry_is_refused_before_its_bytes_are_sent(valkey_store):
    """Declared sizes are checked on the server: the client never receives more than it allows."""
    from arraykv.store import EntryError

    name = valkey_store.name_of(KEYS[0])
    c = valkey_store.client
    valkey_store.max_entry_bytes = 1 << 20
    cases = [
        ({"data": b"z" * (2 << 20), "nbytes": str(2 << 20), "sha256": "0" * 64}, "more than max_entry_bytes"),
        ({"data": b"z" * 100, "nbytes": "10", "sha256": "0" * 64}, "declares 10 bytes but holds 100"),
        ({"data": b"z" * 100, "nbytes": "1e400", "sha256": "0" * 64}, "not a number"),
        ({"data": b"z" * 100, "nbytes": "-5", "sha256": "0" * 64}, "not a number"),
        ({"data": b"z" * 100, "nbytes": "100", "sha256": "0" * 63}, "sha256"),
        ({"data": b"z" * 100, "nbytes": "100", "sha256": "0" * 64}, "corrupted"),
        ({"data": b"z" * 100}, "no nbytes"),
    ]
    for fields, why in cases:
        c.delete(name)
        c.hset(name, mapping=fields)
        with pytest.raises(EntryError, match=why):
            valkey_store.get(KEYS[0])
    c.delete(name)
    c.set(name, b"a string, not an entry")
    from arraykv.store import StoreError

    with pytest.raises(StoreError, match="WRONGTYPE"):
        valkey_store.get(KEYS[0])


def _prefix_in_processes(backend, tmp_path, writers: int) -> None:
    """``writers`` processes prefill one prompt through ``backend`` at once; this process then
    restores their prefix and must get their logits, which must be a fresh run's."""
    from tiny_models import store_model, store_prompt

    spec, prefix = spec_of(backend)
    procs = [worker("prefix", spec, prefix, "pqo4", 150, 64, tmp_path / f"{i}.npz") for i in range(writers)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    results = [np.load(tmp_path / f"{i}.npz") for i in range(writers)]
    (entry,) = backend.entries()  # one prefix, one whole entry
    assert entry.nbytes == len(backend.get(entry.key))
    model = store_model()
    ids = store_prompt(150)
    fresh = model.make_cache("pqo4")
    want = segmented_prefill(model, ids, fresh, chunk_tokens=64, chunk_size=32)
    store = PrefixStore(backend, chunk_tokens=64)
    got = store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=32)
    assert store.last_report.reused == 128 and np.array_equal(got, want)
    for r in results:
        assert int(r["reused"]) in (0, 128) and np.array_equal(r["logits"], want)


def test_two_processes_share_one_valkey_and_continue_bit_for_bit(valkey_store, tmp_path):
    """Another process prefills and stores through the server; this one continues from its prefix."""
    _prefix_in_processes(valkey_store, tmp_path, writers=1)


def test_concurrent_writers_of_one_prefix_leave_one_whole_entry(tmp_path):
    """Two processes store the same prefix in one folder at once."""
    _prefix_in_processes(LocalStore(tmp_path / "store"), tmp_path, writers=2)
