"""The backend contract, on the local folder and on a real Valkey server."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from arraykv.storage.cache_file import MAGIC
from arraykv.store import EntryError, EntryInfo, LocalStore, StoreBackend, ValkeyStore

K1, K2, K3 = "11" * 16, "22" * 16, "33" * 16


def payload(seed: int, size: int) -> bytes:
    """Self-checking bytes: the cache file magic number (what a folder store checks first), the
    SHA-256 of the body, then the body."""
    body = hashlib.shake_128(f"{seed}".encode()).digest(size)
    return MAGIC + hashlib.sha256(body).digest() + body


def whole(data: bytes) -> bool:
    return hashlib.sha256(data[40:]).digest() == data[8:40]


def test_round_trip_contains_delete_and_entries(backend):
    assert isinstance(backend, StoreBackend)
    assert backend.get(K1) is None and not backend.contains(K1)
    a, b = payload(1, 1000), payload(2, 5000)
    backend.put(K1, a, tokens=64)
    backend.put(K2, b, tokens=128)
    assert backend.get(K1) == a and backend.get(K2) == b
    assert backend.contains(K1)
    backend.put(K1, b, tokens=128)  # replaced whole
    assert backend.get(K1) == b
    infos = {e.key: e for e in backend.entries()}
    assert set(infos) == {K1, K2}
    assert all(isinstance(e, EntryInfo) and e.nbytes == len(b) for e in infos.values())
    assert backend.delete(K1) and not backend.delete(K1)
    assert backend.get(K1) is None and [e.key for e in backend.entries()] == [K2]


@pytest.mark.parametrize("key", ["../etc/passwd", "AB" * 16, "12", 12, None, "g" * 32])
def test_keys_are_hex_only(backend, key):
    with pytest.raises(ValueError, match="hexadecimal"):
        backend.get(key)
    with pytest.raises(ValueError, match="hexadecimal"):
        backend.put(key, b"x")


def test_an_entry_over_the_limit_is_refused_before_it_is_read(backend):
    backend.put(K1, payload(1, 4000))
    backend.max_entry_bytes = 1000
    with pytest.raises(EntryError, match="max_entry_bytes"):
        backend.get(K1)
    with pytest.raises(EntryError, match="max_entry_bytes"):
        backend.put(K2, payload(2, 4000))
    assert not backend.contains(K2)


def test_evict_drops_least_recently_used_first(backend):
    for i, k in enumerate((K1, K2, K3)):
        backend.put(k, payload(i, 10_000))
        time.sleep(1.05 if isinstance(backend, ValkeyStore) else 0.02)  # IDLETIME counts seconds
    assert backend.touch(K1)  # K1 used last now: K2 is the oldest
    assert not backend.touch("44" * 16)
    dropped = backend.evict(25_000)
    assert dropped == [K2]
    assert backend.contains(K1) and backend.contains(K3)
    assert sum(e.nbytes for e in backend.entries()) <= 25_000


def test_reading_an_entry_is_not_a_use(backend):
    """Only touch (called once an entry was accepted) moves an entry's use time: an entry read
    and refused as damaged must not outlive the good ones in eviction."""
    for i, k in enumerate((K1, K2, K3)):
        backend.put(k, payload(i, 10_000))
        time.sleep(1.05 if isinstance(backend, ValkeyStore) else 0.02)
    assert backend.get(K1) is not None and backend.get(K2) is not None
    assert backend.evict(25_000) == [K1]  # read, but never marked used: still the oldest


def test_ttl_expires_entries(backend):
    backend.ttl = 1.0
    backend.put(K1, payload(1, 100))
    assert backend.get(K1) is not None
    time.sleep(1.3)
    assert backend.get(K1) is None and not backend.contains(K1)
    backend.evict(10**9)
    assert backend.entries() == []


def test_local_store_budget_applies_on_put_and_removes_dead_writers_files(tmp_path):
    store = LocalStore(tmp_path, max_bytes=25_000)
    for i, k in enumerate((K1, K2, K3)):
        store.put(k, payload(i, 10_000))
        time.sleep(0.02)
    assert not store.contains(K1) and store.contains(K2) and store.contains(K3)
    assert store.total_bytes() <= 25_000
    stale = os.path.join(os.path.dirname(store.path_of(K2)), ".tmp-dead.akv")
    with open(stale, "wb") as f:
        f.write(b"half an entry")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert store.get("44" * 16) is None and {e.key for e in store.entries()} == {K2, K3}
    store.evict()
    assert not os.path.exists(stale)


def test_a_folder_store_is_bounded_by_default(tmp_path):
    from arraykv.store.local import DEFAULT_MAX_BYTES

    vfs = os.statvfs(tmp_path)
    assert LocalStore(tmp_path).max_bytes == min(DEFAULT_MAX_BYTES, vfs.f_frsize * vfs.f_blocks // 2)
    assert LocalStore(tmp_path, max_bytes=None).max_bytes is None
    assert LocalStore(tmp_path, max_bytes=123).max_bytes == 123


def test_bad_limits_are_refused(tmp_path):
    for kwargs in (
        {"max_bytes": "big"},
        {"max_bytes": 0},
        {"ttl": -1},
        {"ttl": float("nan")},
        {"max_entry_bytes": None},
        {"max_bytes": True},
    ):
        with pytest.raises(ValueError):
            LocalStore(tmp_path, **kwargs)


def test_valkey_server_evicts_by_size(valkey_store):
    """maxmemory + allkeys-lru on the server: whole entries go, the recent ones stay."""
    client = valkey_store.client
    old = client.config_get("maxmemory")["maxmemory"]
    try:
        used = int(client.info("memory")["used_memory"])
        valkey_store.set_memory_limit(used + 3_000_000)
        for i in range(12):
            valkey_store.put(f"{i:032x}", payload(i, 500_000), tokens=i)
        held = {e.key: e for e in valkey_store.entries()}
        assert 2 <= len(held) < 12
        assert f"{11:032x}" in held  # the last written is never the one evicted
        for key in held:
            assert whole(valkey_store.get(key))
    finally:
        client.config_set("maxmemory", old)
