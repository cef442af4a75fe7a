"""The full contract, checked for every method in ``available_methods()``.

A third party's method registered before the test session is collected is checked too.
"""

from __future__ import annotations

import faulthandler
import struct
import threading

import numpy as np
import pytest

import arraykv
from arraykv import _compat
from arraykv.persist import CacheFileError

from cache_contract import assert_same_snapshot, attend, random_kvq, snapshot
from conftest import BUILTIN_METHODS, to_np

METHODS = list(BUILTIN_METHODS)
HKV, G, D = 2, 2, 64
SCALE = D**-0.5


def make(method, num_layers=3, **options):
    return arraykv.make_cache(method, num_layers=num_layers, num_kv_heads=HKV, head_dim=D, **options)


def held_bytes(cache):
    """Bytes of the arrays the cache actually holds, counted from the arrays themselves."""
    total = cache._fixed_nbytes()
    for i in range(cache.num_layers):
        total += sum(_compat.array_nbytes(a) for a in cache.layer_arrays(i).values())
    return total


@pytest.mark.parametrize("method", METHODS)
def test_shapes_dtypes_namespace_preserved(method, xp, rng):
    cache = make(method)
    k, v, q = random_kvq(rng, xp, 2, HKV, G, 9, D)
    r = cache.prefill(0, k, v, q)
    for a in (r.k, r.v):
        assert tuple(a.shape) == (2, HKV, 9, D)
        assert a.dtype == xp.float32
        assert _compat.namespace(a) is _compat.namespace(k)
    if r.logit_bias is not None:
        assert tuple(r.logit_bias.shape) == (2, HKV * G, 9, 9)
    cfg = arraykv.AttendConfig(SCALE, G)
    for step in range(3):
        k, v, q = random_kvq(rng, xp, 2, HKV, G, 1, D)
        out = cache.decode(0, k, v, q, cfg)
        assert isinstance(out, (arraykv.Fused, arraykv.Dequantized))
        o = attend(out, q, SCALE)
        assert tuple(o.shape) == (2, HKV * G, 1, D) and o.dtype == xp.float32
        assert _compat.namespace(o) is _compat.namespace(q)
        if isinstance(out, arraykv.Dequantized):
            assert tuple(out.result.k.shape) == (2, HKV, 10 + step, D)
    assert cache.seq_len(0) == 12


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_float16_and_float32_keep_their_dtype(method, rng, dtype):
    cache = make(method)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 6, D, dtype)
    r = cache.prefill(1, k, v, q)
    assert r.k.dtype == np.dtype(dtype) and r.v.dtype == np.dtype(dtype)
    assert r.logit_bias is None or r.logit_bias.dtype == np.dtype(dtype)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 1, D, dtype)
    out = attend(cache.decode(1, k, v, q, arraykv.AttendConfig(SCALE, G)), q, SCALE)
    assert out.dtype == np.dtype(dtype)
    assert np.all(np.isfinite(out.astype(np.float32)))


@pytest.mark.parametrize("method", METHODS)
def test_mixed_sequence_keeps_every_token_in_order(method, rng):
    """Several prefills, decodes, prefill after decode, batch 3: every stored token is the
    reconstruction of the token given at that position (closer to it than to any other)."""
    cache = make(method)
    cfg = arraykv.AttendConfig(SCALE, G)
    given = []
    for t in (9, 5, 1, 1, 1, 4, 1, 1):
        k, v, q = random_kvq(rng, np, 3, HKV, G, t, D)
        if t == 1:
            cache.decode(2, k, v, q, cfg)
        else:
            cache.prefill(2, k, v, q)
        given.append(k)
    exact = np.concatenate(given, axis=2).astype(np.float64)
    assert cache.seq_len(2) == exact.shape[2] == 23
    got = to_np(cache.dequantize(2).k).astype(np.float64)
    assert got.shape == exact.shape
    # distance of every reconstructed token to every given token of the same (batch, head)
    dist = ((got[:, :, :, None, :] - exact[:, :, None, :, :]) ** 2).sum(-1)
    assert np.all(np.argmin(dist, axis=-1) == np.arange(23))
    rel = ((got - exact) ** 2).sum() / (exact**2).sum()
    assert rel < 0.5, rel


@pytest.mark.parametrize("method", METHODS)
def test_memory_usage_counts_what_is_held_grows_linearly_and_resets(method, rng):
    cache = make(method, num_layers=2)
    baseline = cache.memory_usage()
    assert baseline == cache._fixed_nbytes()
    cfg = arraykv.AttendConfig(SCALE, G)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 64, D)
    cache.prefill(0, k, v, q)
    sizes = {}
    for n in range(65, 64 + 3 * 128 + 1):
        k, v, q = random_kvq(rng, np, 1, HKV, G, 1, D)
        cache.decode(0, k, v, q, cfg)
        if n in (192, 320, 448):
            used = cache.used_bytes()
            held = held_bytes(cache)  # every array, the rollback copies included
            assert abs(used + cache.rollback_bytes() - held) <= 0.01 * held, (used, held)
            assert cache.memory_usage() == cache.reserved_bytes() >= used
            for buf in cache._states[0].buffers():  # spare room bounded: 1.1 x used + one step
                assert buf.capacity <= 1.1 * buf.length + buf.min_capacity, (buf.capacity, buf.length)
            sizes[n] = used
    step1, step2 = sizes[320] - sizes[192], sizes[448] - sizes[320]
    assert step1 > 0 and abs(step1 - step2) <= 0.01 * step1, sizes
    # not more than float32 K/V of the same tokens
    assert step1 <= 128 * 2 * HKV * D * 4
    cache.reset()
    assert cache.memory_usage() == baseline
    assert all(cache.seq_len(i) == 0 for i in range(2))


def _script(cache, layer, seed, steps=12):
    """A mixed prefill/decode workload on one layer; returns every output as NumPy."""
    rng = np.random.default_rng(seed)
    cfg = arraykv.AttendConfig(SCALE, G)
    outs = []
    for i in range(steps):
        t = 1 if i % 4 else int(rng.integers(2, 9))
        k, v, q = random_kvq(rng, np, 2, HKV, G, t, D)
        if t == 1:
            outs.append(np.array(attend(cache.decode(layer, k, v, q, cfg), q, SCALE)))
        else:
            r = cache.prefill(layer, k, v, q)
            outs.append(np.array(r.k))
    return outs


def _run_threads(fns, timeout=120):
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as exc:  # reported below
            errors.append(exc)

    faulthandler.dump_traceback_later(timeout, exit=False)
    try:
        threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        alive = [t for t in threads if t.is_alive()]
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not alive, f"{len(alive)} threads did not finish: deadlock?"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("method", METHODS)
def test_16_threads_match_a_sequential_run_bit_for_bit(method):
    layers = 16
    seq = make(method, num_layers=layers)
    want = [_script(seq, i, 1000 + i) for i in range(layers)]
    par = make(method, num_layers=layers)
    got = [None] * layers

    def job(i):
        def run():
            got[i] = _script(par, i, 1000 + i)

        return run

    _run_threads([job(i) for i in range(layers)])
    for w, g in zip(want, got):
        assert len(w) == len(g)
        for a, b in zip(w, g):
            np.testing.assert_array_equal(a, b)
    assert_same_snapshot(snapshot(seq), snapshot(par))


@pytest.mark.parametrize("method", METHODS)
def test_reset_during_decodes_never_leaves_a_half_reset_layer(method):
    cache = make(method, num_layers=4)
    rng = np.random.default_rng(5)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 1, D)
    cfg = arraykv.AttendConfig(SCALE, G)
    stop = threading.Event()

    def decoder(layer):
        def run():
            while not stop.is_set():
                out = cache.decode(layer, k, v, q, cfg)
                assert np.all(np.isfinite(np.asarray(attend(out, q, SCALE))))

        return run

    def resetter():
        for _ in range(30):
            cache.reset()
        stop.set()

    _run_threads([decoder(i) for i in range(4)] + [resetter])
    for i in range(4):
        n = cache.seq_len(i)
        arrays = cache.layer_arrays(i)
        r = cache.dequantize(i)
        assert (r is None) == (n == 0) == (not arrays)
        if r is not None:
            assert r.k.shape[2] == n


@pytest.mark.parametrize("method", METHODS)
def test_save_load_round_trip_is_bit_exact(method, rng, tmp_path):
    cache = make(method)
    cfg = arraykv.AttendConfig(SCALE, G)
    k, v, q = random_kvq(rng, np, 2, HKV, G, 40, D)
    cache.prefill(0, k, v, q)
    cache.prefill(2, k[:, :, :7], v[:, :, :7], q[:, :, :7])
    for _ in range(5):
        k1, v1, q1 = random_kvq(rng, np, 2, HKV, G, 1, D)
        cache.decode(0, k1, v1, q1, cfg)
    path = tmp_path / "c.akv"
    cache.save(path)
    loaded = arraykv.load(path)
    assert type(loaded) is type(cache) and loaded.get_config() == cache.get_config()
    assert_same_snapshot(snapshot(cache), snapshot(loaded))
    assert loaded.used_bytes() == cache.used_bytes()
    assert loaded.memory_usage() <= cache.memory_usage()  # loaded buffers are sized exactly
    # the loaded cache continues exactly like the original
    k1, v1, q1 = random_kvq(rng, np, 2, HKV, G, 1, D)
    a = np.asarray(attend(cache.decode(0, k1, v1, q1, cfg), q1, SCALE))
    b = np.asarray(attend(loaded.decode(0, k1, v1, q1, cfg), q1, SCALE))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_damaged_files_are_refused(method, rng, tmp_path):
    cache = make(method)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 12, D)
    cache.prefill(1, k, v, q)
    path = tmp_path / "c.akv"
    cache.save(path)
    data = path.read_bytes()
    bad = tmp_path / "bad.akv"
    cases = {
        "truncated": data[: len(data) // 2],
        "truncated tail": data[:-1],
        "empty": b"",
        "flipped byte": data[:200] + bytes([data[200] ^ 0x40]) + data[201:],
        "flipped last data byte": data[:-33] + bytes([data[-33] ^ 1]) + data[-32:],
        "wrong version": data[:8] + struct.pack("<I", 99) + data[12:],
        "not a cache": b"PK\x03\x04" + data[4:],
    }
    for blob in cases.values():
        bad.write_bytes(blob)
        with pytest.raises(CacheFileError):
            arraykv.load(bad)
    with pytest.raises(FileNotFoundError):
        arraykv.load(tmp_path / "missing.akv")


@pytest.mark.parametrize("method", METHODS)
def test_growth_is_amortized_and_max_tokens_is_enforced(method, rng):
    cache = make(method, num_layers=1)
    cfg = arraykv.AttendConfig(SCALE, G)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 1, D)
    for _ in range(1500):
        cache.decode(0, k, v, q, cfg)
    buffers = len(cache._states[0].buffers())
    # steps of at most 64 tokens (4 int key groups): about ceil(1500 / 64) = 24 per buffer for 1500 tokens
    assert cache.reallocations() <= 24 * max(buffers, 1), cache.reallocations()

    capped = make(method, num_layers=1, max_tokens=20)
    k, v, q = random_kvq(rng, np, 1, HKV, G, 15, D)
    capped.prefill(0, k, v, q)
    before = snapshot(capped)
    with pytest.raises(ValueError, match="max_tokens"):
        capped.prefill(0, k[:, :, :6], v[:, :, :6], q[:, :, :6])
    assert_same_snapshot(before, snapshot(capped))
    for _ in range(5):
        capped.decode(0, *random_kvq(rng, np, 1, HKV, G, 1, D), cfg)
    with pytest.raises(ValueError, match="max_tokens"):
        capped.decode(0, *random_kvq(rng, np, 1, HKV, G, 1, D), cfg)
    assert capped.seq_len(0) == 20
