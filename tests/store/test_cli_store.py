"""``python -m arraykv store``: a store's entries and bytes, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arraykv.__main__ import main
from arraykv.store import LocalStore

K1, K2 = "ab" * 16, "cd" * 16


def test_store_ls_shows_entries_tokens_and_bytes(model, tmp_path, capsys):
    from arraykv.store import PrefixStore

    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=32, policy="every")
    store.prefill(model, list(range(70)), model.make_cache("pqo4"), chunk_size=16)
    sizes = sorted(e.nbytes for e in store.backend.entries())
    assert main(["store", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 64 |" in out and "| 32 |" in out
    assert "2 entries" in out and f"({sum(sizes)} bytes)" in out
    assert main(["store", "evict", str(tmp_path), "--max-bytes", str(sizes[-1])]) == 0
    assert "dropped 1 entries" in capsys.readouterr().out
    (left,) = store.backend.entries()
    assert main(["store", "rm", str(tmp_path), left.key]) == 0
    assert store.backend.entries() == []


def test_store_ls_of_a_server(valkey_store, capsys):
    valkey_store.put(K1, b"x" * 1234, tokens=512)
    valkey_store.put(K2, b"y" * 10, tokens=1024)
    kw = valkey_store.client.connection_pool.connection_kwargs
    url = f"redis://{kw['host']}:{kw['port']}/0"
    res = subprocess.run(
        [sys.executable, "-m", "arraykv", "store", "ls", url, "--prefix", valkey_store.prefix],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "| 512 | 1.23 kB |" in res.stdout and "| 1024 | 10 B |" in res.stdout
    assert "2 entries, 1.24 kB (1244 bytes)" in res.stdout


def test_store_errors_are_one_line(tmp_path, capsys):
    assert main(["store", "ls", str(tmp_path / "missing")]) == 2
    assert "no store folder" in capsys.readouterr().err
    assert main(["store", "rm", str(tmp_path)]) == 2
    assert "at least one key" in capsys.readouterr().err


def _folder_with(tmp_path, *keys):
    store = LocalStore(tmp_path / "s")
    for i, key in enumerate(keys):
        store.put(key, b"z" * (10 + i), tokens=16 * (i + 1))
    return store


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("arraykv store: error: "), err
    return err


def test_rm_takes_whole_keys_only_and_never_an_empty_one(tmp_path, capsys):
    store = _folder_with(tmp_path, K1)
    for bad in ("", K1[:10], K1.upper(), K1[:-1], K1 + "0"):
        assert main(["store", "rm", store.root, bad]) == 2
        said = "rm takes whole keys" if len(bad) < 16 or bad != bad.lower() else "the store holds no entry"
        assert said in _one_line(capsys)
        assert [e.key for e in store.entries()] == [K1]  # the only entry is still there
    assert main(["store", "rm", store.root, K2]) == 2  # whole, but not held
    assert "holds no entry" in _one_line(capsys)
    assert main(["store", "rm", store.root, K1, K2]) == 2  # one missing: none removed
    assert [e.key for e in store.entries()] == [K1]
    capsys.readouterr()
    assert main(["store", "rm", store.root, K1, K1]) == 2
    assert "given more than once" in _one_line(capsys)
    assert main(["store", "rm", store.root, K1]) == 0
    assert store.entries() == []


def test_ls_prints_the_whole_keys_rm_takes(tmp_path, capsys):
    store = _folder_with(tmp_path, K1, K2)
    assert main(["store", "ls", store.root]) == 0
    out = capsys.readouterr().out
    assert f"| {K1} |" in out and f"| {K2} |" in out


@pytest.mark.parametrize(
    "argv, said",
    [
        (["ls", "{store}", K1], "ls takes no keys, received"),
        (["evict", "{store}", K1, "--max-bytes", "5"], "evict takes no keys"),
        (["evict", "{store}"], "evict needs --max-bytes N"),
        (["ls", "{store}", "--max-bytes", "5"], "--max-bytes does not apply with store ls"),
        (["rm", "{store}", K1, "--max-bytes", "5"], "--max-bytes does not apply with store rm"),
        (["ls", "{store}", "--prefix", "mine:"], "--prefix does not apply with a store folder"),
        (["ls", "ftp://somewhere/x"], "neither a store folder nor a server URL"),
    ],
)
def test_flags_that_do_not_apply_are_refused_and_change_nothing(tmp_path, capsys, argv, said):
    store = _folder_with(tmp_path, K1, K2)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = [a.replace("{store}", store.root) for a in argv]
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)  # where a store folder of a URL no backend takes would be made
    try:
        assert main(["store", *argv]) == 2
    finally:
        os.chdir(cwd)
    assert said in _one_line(capsys)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert sorted(e.key for e in store.entries()) == [K1, K2]


def _url(valkey_store, scheme="redis"):
    kw = valkey_store.client.connection_pool.connection_kwargs
    return f"{scheme}://{kw['host']}:{kw['port']}/0"


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_every_action_takes_the_server_urls_store_takes(valkey_store, capsys, scheme):
    from arraykv.store import ValkeyStore, open_backend

    url = _url(valkey_store, scheme)
    assert isinstance(open_backend(url), ValkeyStore)  # a spec store= takes ...
    valkey_store.put(K1, b"x" * 2000, tokens=512)
    valkey_store.put(K2, b"y" * 10, tokens=1024)
    prefix = ["--prefix", valkey_store.prefix]
    assert main(["store", "ls", url, *prefix]) == 0  # ... the command takes too
    out = capsys.readouterr().out
    assert f"| {K1} | 512 |" in out and "2 entries" in out
    assert main(["store", "rm", url, K2[:8], *prefix]) == 2
    assert "rm takes whole keys" in _one_line(capsys)
    assert main(["store", "rm", url, K2, *prefix]) == 0
    assert [e.key for e in valkey_store.entries()] == [K1]
    assert main(["store", "evict", url, "--max-bytes", "100", *prefix]) == 0
    assert "dropped 1 entries" in capsys.readouterr().out
    assert valkey_store.entries() == []


def test_every_action_takes_a_cluster_url(cluster_url, capsys, request):
    import zlib

    from arraykv.store import ValkeyStore

    prefix = f"cli{zlib.crc32(request.node.nodeid.encode()):08x}:"
    store = ValkeyStore(cluster_url, prefix=prefix)
    keys = [f"{i:02x}" * 16 for i in range(1, 7)]  # spread over the nodes' slots
    for i, key in enumerate(keys):
        store.put(key, b"c" * (100 + i), tokens=32)
    try:
        assert main(["store", "ls", cluster_url, "--prefix", prefix]) == 0
        out = capsys.readouterr().out
        assert all(f"| {k} | 32 |" in out for k in keys) and "6 entries" in out
        assert main(["store", "rm", cluster_url, keys[0], keys[1], "--prefix", prefix]) == 0
        assert sorted(e.key for e in store.entries()) == keys[2:]
        assert main(["store", "evict", cluster_url, "--max-bytes", "250", "--prefix", prefix]) == 0
        assert len(store.entries()) == 2
    finally:
        for e in store.entries():
            store.delete(e.key)
