"""``python -m arraykv store``: a store's entries and bytes, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

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
    assert main(["store", "rm", str(tmp_path), left.key[:10]]) == 0
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
