"""Hostile and inconsistent cache files are refused with CacheFileError, cheaply and before building."""

from __future__ import annotations

import hashlib
import json
import struct
import time

import numpy as np
import pytest

import arraykv
from arraykv.storage.cache_file import MAGIC, CacheFileError, read_cache_file

from conftest import BUILTIN_METHODS


def _file(path, header: dict, data: bytes = b""):
    """A well-formed file (right magic, version and digest) around ``header`` and ``data``."""
    h = json.dumps(header).encode()
    body = MAGIC + struct.pack("<IQ", 1, len(h)) + h + data
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def _saved(tmp_path, method="dense", tokens=7):
    cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=1, head_dim=8)
    r = np.random.default_rng(0)
    x = r.standard_normal((1, 1, tokens, 8)).astype(np.float32)
    cache.prefill(0, x, x, x)
    cache.save(tmp_path / "ok.akv")
    data = (tmp_path / "ok.akv").read_bytes()
    hlen = struct.unpack_from("<IQ", data, len(MAGIC))[1]
    start = len(MAGIC) + 12
    return json.loads(data[start : start + hlen]), data[start + hlen : -32]


def test_a_tiny_file_declaring_a_billion_layers_is_refused_at_once(tmp_path):
    cfg = {"method": "dense", "num_layers": 10**9, "num_kv_heads": 1, "head_dim": 8}
    path = _file(tmp_path / "big.akv", {"config": cfg, "layers": [None], "arrays": []})
    assert path.stat().st_size < 300
    t0 = time.perf_counter()
    with pytest.raises(CacheFileError, match="layers"):
        arraykv.load(path)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("method", ["dense", "int4", "int8"])
def test_a_declared_length_that_the_arrays_do_not_hold_is_refused(tmp_path, method):
    header, data = _saved(tmp_path, method, tokens=73)
    header["layers"][0]["length"] = 78
    with pytest.raises(CacheFileError, match="78"):
        arraykv.load(_file(tmp_path / "long.akv", header, data))


@pytest.mark.parametrize("dtype", ["os.system", "object", "__class__", "|O", "bool_", 7])
def test_dtype_names_are_checked_not_looked_up(tmp_path, dtype):
    header, data = _saved(tmp_path)
    header["layers"][0]["dtype"] = dtype
    with pytest.raises(CacheFileError, match="dtype"):
        arraykv.load(_file(tmp_path / "d.akv", header, data))
    header, data = _saved(tmp_path)
    header["arrays"][0]["dtype"] = dtype if dtype != "bool_" else "|O"
    with pytest.raises(CacheFileError, match="dtype"):
        arraykv.load(_file(tmp_path / "a.akv", header, data))


@pytest.mark.parametrize(
    "field,value",
    [("shape", [10**9, 10**9]), ("offset", -4), ("nbytes", 10**12), ("layer", 5), ("layer", True), ("shape", "7")],
)
def test_array_entries_must_fit_the_data(tmp_path, field, value):
    header, data = _saved(tmp_path)
    header["arrays"][0][field] = value
    with pytest.raises(CacheFileError):
        read_cache_file(_file(tmp_path / "e.akv", header, data))


def test_unknown_methods_and_bad_options_are_cache_file_errors(tmp_path):
    header, data = _saved(tmp_path)
    header["config"]["method"] = "no-such-method"
    with pytest.raises(CacheFileError, match="not registered"):
        arraykv.load(_file(tmp_path / "m.akv", header, data))
    header, data = _saved(tmp_path)
    header["config"]["head_dim"] = -3
    with pytest.raises(CacheFileError, match="builds no cache"):
        arraykv.load(_file(tmp_path / "o.akv", header, data))


def test_a_good_file_still_loads(tmp_path):
    _saved(tmp_path, "int4", tokens=40)
    back = arraykv.load(tmp_path / "ok.akv")
    assert back.seq_len(0) == 40 and back.seq_len(1) == 0


@pytest.mark.parametrize("method", BUILTIN_METHODS)
def test_snapshot_and_restore_round_trip_and_a_bad_restore_changes_nothing(method):
    cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=2, head_dim=16)
    r = np.random.default_rng(1)
    k = r.standard_normal((1, 2, 50, 16)).astype(np.float32)
    q = r.standard_normal((1, 4, 50, 16)).astype(np.float32)
    cache.prefill(1, k, k * 0.5, q)
    snap = cache.snapshot()
    other = arraykv.make_cache(**cache.get_config())
    other.restore(snap)
    for a, b in ((cache, other),):
        assert a.seq_len(1) == b.seq_len(1) == 50 and b.seq_len(0) == 0
        np.testing.assert_array_equal(np.asarray(a.dequantize(1).v), np.asarray(b.dequantize(1).v))
    broken = list(snap)
    broken[0] = snap[1].__class__(length=3, batch=1, dtype="float32", arrays=snap[1].arrays)
    with pytest.raises(ValueError):
        other.restore(broken)
    assert other.seq_len(0) == 0 and other.seq_len(1) == 50
