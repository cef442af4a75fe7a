"""The store on a real three-primary Valkey Cluster (the same server binary), a node killed mid-run included."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from arraykv.store import PrefixStore, StoreError, StoreWarning, ValkeyStore, open_backend, segmented_prefill
from arraykv.store.server import ValkeyCluster

from tiny_models import store_prompt

S, CHUNK = 64, 32


@pytest.fixture
def store(cluster_url, request):
    import zlib

    s = ValkeyStore(cluster_url, prefix=f"c{zlib.crc32(request.node.nodeid.encode()):08x}:")
    yield s
    for e in s.entries():
        s.delete(e.key)


def test_the_cluster_helper_splits_the_slots_in_three():
    c = ValkeyCluster(3)
    assert c.slot_ranges() == [(0, 5460), (5461, 10922), (10923, 16383)]
    assert c.url.startswith("redis+cluster://127.0.0.1:") and c.url.count(",") == 2
    for bad in (0, True, "3", 65):
        with pytest.raises(ValueError, match="primaries"):
            ValkeyCluster(bad)


def test_the_backend_contract_on_a_cluster(store):
    assert store.cluster
    keys = [f"{i:032x}" for i in range(24)]
    for i, k in enumerate(keys):
        store.put(k, b"ARRAYKV\0" + bytes([i]) * 1000, tokens=i)
    assert all(store.get(k) == b"ARRAYKV\0" + bytes([i]) * 1000 for i, k in enumerate(keys))
    infos = {e.key: e for e in store.entries()}
    assert set(infos) == set(keys) and infos[keys[5]].tokens == 5
    per_node = [
        sum(1 for _ in store.client.get_valkey_connection(n).scan_iter(match=f"{store.prefix}*"))
        for n in store.client.get_primaries()
    ]
    assert len(per_node) == 3 and sum(per_node) == 24 and sum(c > 0 for c in per_node) >= 2  # spread
    assert store.touch(keys[0]) and not store.touch("ff" * 16)
    assert store.contains(keys[1]) and store.delete(keys[1]) and not store.contains(keys[1])
    assert len(store.evict(10 * 1008)) == 13 and len(store.entries()) == 10  # entries of 1,008 bytes


def test_cluster_forms_of_the_address(cluster_url):
    nodes = cluster_url.split("://", 1)[1].split(",")
    for spec in (nodes, cluster_url.replace("redis+", "valkey+"), [tuple(n.rsplit(":", 1)) for n in nodes]):
        s = ValkeyStore(spec, prefix="forms:")
        s.put("ab" * 16, b"ARRAYKV\0forms")
        assert s.cluster and s.get("ab" * 16) == b"ARRAYKV\0forms"
        s.delete("ab" * 16)
    backend = open_backend(cluster_url.replace("redis+", "valkey+"))
    assert isinstance(backend, ValkeyStore) and backend.cluster
    for bad in ("redis+cluster://", "redis+cluster://host", "redis+cluster://h:0", ["h:p"], [("h",)]):
        with pytest.raises(ValueError, match="cluster"):
            ValkeyStore(bad)


def test_a_cluster_that_is_down_fails_calls_not_the_constructor(model):
    from arraykv.store.server import free_port

    s = ValkeyStore(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}")  # nothing there
    with pytest.raises(StoreError):
        s.get("ab" * 16)
    ids = store_prompt(2 * S + 5)
    want = segmented_prefill(model, ids, model.make_cache("pqo4"), chunk_tokens=S, chunk_size=CHUNK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = PrefixStore(s, chunk_tokens=S).prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)
    assert np.array_equal(got, want) and any(issubclass(w.category, StoreWarning) for w in caught)


def test_a_prefix_continued_from_the_cluster_equals_a_fresh_run(model, store):
    ids = store_prompt(3 * S + 9)
    want = segmented_prefill(model, ids, model.make_cache("pqo4"), chunk_tokens=S, chunk_size=CHUNK)
    ps = PrefixStore(store, chunk_tokens=S, policy="every")
    cold = ps.prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)
    assert ps.last_report.stored == [S, 2 * S, 3 * S] and np.array_equal(cold, want)
    warm = ps.prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)
    assert ps.last_report.reused == 3 * S and np.array_equal(warm, want)


def test_a_node_killed_mid_run_costs_warnings_and_recomputation_never_a_wrong_result(model):
    """Eight prompts stored over the three nodes; one node is killed; every prompt again: the
    results are those of no store, the entries on live nodes are still used."""
    prompts = [store_prompt(2 * S + 7, seed) for seed in range(8)]
    wants = [segmented_prefill(model, p, model.make_cache("pqo4"), chunk_tokens=S, chunk_size=CHUNK) for p in prompts]
    with ValkeyCluster(3) as cluster:
        ps = PrefixStore(cluster.url, chunk_tokens=S, policy="every")
        for p, want in zip(prompts, wants):
            assert np.array_equal(ps.prefill(model, p, model.make_cache("pqo4"), chunk_size=CHUNK), want)
        cluster.kill(1)
        reused, warned = 0, 0
        for p, want in zip(prompts, wants):
            t0 = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = ps.prefill(model, p, model.make_cache("pqo4"), chunk_size=CHUNK)
            assert time.monotonic() - t0 < 20.0
            assert np.array_equal(got, want)
            reused += ps.last_report.reused > 0
            warned += any(issubclass(w.category, StoreWarning) for w in caught)
            time.sleep(ps.backend.open_for)  # past the back-off: the next prompt asks the cluster again
        assert warned >= 1  # the dead node's entries
        assert reused >= 1  # the live nodes' entries


def test_the_server_command_starts_a_cluster(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "arraykv.store.server", "--cluster", "3", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        url = ready.read_text()
        assert url.startswith("redis+cluster://")
        s = ValkeyStore(url)
        s.put("cd" * 16, b"ARRAYKV\0cli")
        assert s.get("cd" * 16) == b"ARRAYKV\0cli"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
