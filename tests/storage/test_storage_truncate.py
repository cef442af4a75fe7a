"""truncate on the paged and MLA caches: as if the later tokens had never been appended."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from arraykv import MlaCache, PagedKVCache
from arraykv.storage import TokenBuffers

H, D = 2, 8
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def paged(**kw):
    return PagedKVCache(**{**dict(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4, num_blocks=16), **kw})


def tok(rng, t):
    return rng.standard_normal((H, t, D)).astype(np.float32), rng.standard_normal((H, t, D)).astype(np.float32)


@SETTINGS
@given(
    steps=st.lists(st.tuples(st.integers(0, 1), st.integers(1, 9), st.floats(0.0, 1.0)), min_size=1, max_size=12),
    seed=st.integers(0, 2**31),
)
def test_paged_truncate_equals_appending_less(steps, seed):
    rng = np.random.default_rng(seed)
    cache = paged()
    seqs = [cache.allocate_sequence(), cache.allocate_sequence()]
    held = {s: [] for s in seqs}  # (k, v) per token
    for which, t, frac in steps:
        sid = seqs[which]
        if frac < 0.5:
            k, v = tok(rng, t)
            try:
                cache.append(0, sid, k, v)
            except ValueError:
                continue  # out of blocks: nothing written
            held[sid] += [(k[:, i], v[:, i]) for i in range(t)]
        else:
            length = int((frac - 0.5) * 2 * len(held[sid]))
            cache.truncate(0, sid, length)
            held[sid] = held[sid][:length]
        direct = paged()
        for s in seqs:
            direct.allocate_sequence()
            if held[s]:
                direct.append(0, s, np.stack([k for k, _ in held[s]], 1), np.stack([v for _, v in held[s]], 1))
        for s in seqs:
            assert cache.seq_len(0, s) == direct.seq_len(0, s) == len(held[s])
            assert len(cache.block_table(0, s)) == -(-len(held[s]) // 4)
            if held[s]:
                k, v = cache.get_kv(0, s)
                dk, dv = direct.get_kv(0, s)
                np.testing.assert_array_equal(k, dk)
                np.testing.assert_array_equal(v, dv)
        assert cache.memory_usage() == direct.memory_usage()
        assert cache.free_blocks(0) == direct.free_blocks(0)


def test_paged_truncate_returns_blocks_and_free_still_catches_double_free():
    rng = np.random.default_rng(0)
    cache = paged()
    a, b = cache.allocate_sequence(), cache.allocate_sequence()
    cache.append(0, a, *tok(rng, 10))  # blocks 0, 1, 2
    cache.append(0, b, *tok(rng, 3))  # block 3
    assert cache.free_blocks(0) == 12
    cache.truncate(0, a, 5)  # keeps 2 blocks
    assert cache.block_table(0, a) == [0, 1] and cache.free_blocks(0) == 13
    cache.append(0, a, *tok(rng, 4))  # reuses the freed block first
    assert cache.block_table(0, a) == [0, 1, 2]
    cache.truncate(0, a, 0)
    assert cache.block_table(0, a) == [] and cache.seq_len(0, a) == 0 and cache.free_blocks(0) == 15
    cache.free(a)
    with pytest.raises(ValueError, match="already freed"):
        cache.free(a)
    with pytest.raises(ValueError, match="was freed"):
        cache.truncate(0, a, 0)
    cache.free(b)
    assert cache.free_blocks(0) == 16 and sorted(cache._layers[0].free) == list(range(16))  # each block once


def test_paged_truncate_errors_change_nothing():
    rng = np.random.default_rng(1)
    cache = paged()
    a = cache.allocate_sequence()
    cache.append(1, a, *tok(rng, 6))
    for args, exc in (
        ((1, a, 7), ValueError),
        ((1, a, -1), ValueError),
        ((1, a, 2.0), TypeError),
        ((2, a, 1), ValueError),
        (("1", a, 1), TypeError),
        ((1, a + 1, 1), ValueError),
        ((0, a, 1), ValueError),
    ):
        with pytest.raises(exc):
            cache.truncate(*args)
    assert cache.seq_len(1, a) == 6 and cache.free_blocks(1) == 14


def test_paged_concurrent_truncates():
    rng = np.random.default_rng(2)
    cache = paged(num_layers=4, num_blocks=64)
    seqs = [cache.allocate_sequence() for _ in range(3)]
    for layer in range(4):
        for s in seqs:
            cache.append(layer, s, *tok(rng, 20))
    errors = []

    def work(layer):
        try:
            for s in seqs:
                for length in (15, 9, 4):
                    cache.truncate(layer, s, length)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(cache.free_blocks(i) == 64 - 3 for i in range(4))


def mla():
    c = MlaCache(num_layers=2, num_heads=H, head_dim=D, latent_dim=4, rope_dim=2, v_head_dim=D)
    rng = np.random.default_rng(3)
    for layer in range(2):
        c.fit(layer, *tok(rng, 32))
    return c


def test_mla_truncate_equals_appending_less():
    rng = np.random.default_rng(4)
    cache, direct = mla(), mla()
    sid = cache.allocate_sequence()
    direct.allocate_sequence()
    parts = [tok(rng, t) for t in (7, 1, 1, 5)]
    for k, v in parts:
        cache.append(0, sid, k, v)
    cache.truncate(0, sid, 10)
    k = np.concatenate([p[0] for p in parts], 1)[:, :10]
    v = np.concatenate([p[1] for p in parts], 1)[:, :10]
    direct.append(0, sid, k[:, :7], v[:, :7])
    direct.append(0, sid, k[:, 7:8], v[:, 7:8])
    direct.append(0, sid, k[:, 8:9], v[:, 8:9])
    direct.append(0, sid, k[:, 9:10], v[:, 9:10])
    assert cache.seq_len(0, sid) == direct.seq_len(0, sid) == 10
    # token 9 was projected inside a 5-row matrix product and, directly, in a one-row product:
    # BLAS may round the two differently (one float32 ulp, seen on an AVX-512 machine)
    for a, b in zip(
        cache.get_kv(0, sid) + cache.get_compressed_kv(0, sid), direct.get_kv(0, sid) + direct.get_compressed_kv(0, sid)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert cache.memory_usage() == direct.memory_usage()
    cache.truncate(0, sid, 0)
    assert cache.seq_len(0, sid) == 0 and cache.memory_usage() == 0
    cache.append(0, sid, k[:, :3], v[:, :3])
    assert cache.seq_len(0, sid) == 3


def test_mla_truncate_errors():
    rng = np.random.default_rng(5)
    cache = mla()
    sid = cache.allocate_sequence()
    cache.append(0, sid, *tok(rng, 4))
    for args, exc in (
        ((0, sid, 5), ValueError),
        ((0, sid, -1), ValueError),
        ((0, sid, 1.5), TypeError),
        ((2, sid, 1), ValueError),
        ((0, sid + 7, 1), ValueError),
        ((1, sid, 1), ValueError),
    ):
        with pytest.raises(exc):
            cache.truncate(*args)
    assert cache.seq_len(0, sid) == 4
    cache.free(sid)
    with pytest.raises(ValueError, match="already freed"):
        cache.free(sid)


def test_token_buffers_truncate_keeps_room_within_the_growth_bound():
    buf = TokenBuffers(min_capacity=4)
    a = np.arange(2 * 200, dtype=np.float32).reshape(1, 2, 200, 1)
    buf.append({"a": a})
    buf.truncate(190)  # 200 <= 1.1 * 190 + 4: room kept, nothing copied
    assert buf.capacity == 200 and buf.length == 190
    buf.truncate(20)  # 200 > 1.1 * 20 + 4: released, exact
    assert buf.capacity == 20 and buf.reserved_nbytes() == buf.used_nbytes()
    np.testing.assert_array_equal(buf.view("a"), a[:, :, :20])
    buf.truncate(0)
    assert buf.capacity == 0 and buf.reserved_nbytes() == 0
    with pytest.raises(ValueError, match="length"):
        buf.truncate(1)
    copy = TokenBuffers(min_capacity=4)
    copy.append({"a": a})
    twin = copy.copy()
    twin.truncate(3)
    assert copy.length == 200 and twin.length == 3


def test_paged_fork_is_independent():
    rng = np.random.default_rng(8)
    cache = paged()
    a = cache.allocate_sequence()
    cache.append(0, a, *tok(rng, 6))
    twin = cache.fork()
    np.testing.assert_array_equal(twin.get_kv(0, a)[0], cache.get_kv(0, a)[0])
    twin.append(0, a, *tok(rng, 3))
    twin.truncate(0, a, 2)
    b = twin.allocate_sequence()
    assert cache.seq_len(0, a) == 6 and twin.seq_len(0, a) == 2 and cache.sequences() == [a]
    assert twin.sequences() == [a, b] and cache.allocate_sequence() == b  # the same next id, apart
    k0 = cache.get_kv(0, a)[0]
    twin.free(a)
    np.testing.assert_array_equal(cache.get_kv(0, a)[0], k0)
    assert cache.memory_usage() == 2 * 4 * H * D * 4 * 2


def test_mla_fork_is_independent():
    rng = np.random.default_rng(9)
    cache = mla()
    sid = cache.allocate_sequence()
    cache.append(0, sid, *tok(rng, 5))
    twin = cache.fork()
    assert twin.memory_usage() == cache.memory_usage()
    twin.truncate(0, sid, 2)
    twin.reset_layer(1)
    twin.fit(1, *tok(rng, 16))
    assert cache.seq_len(0, sid) == 5 and twin.seq_len(0, sid) == 2
    assert cache.projection(1)[0] is not twin.projection(1)[0]
    np.testing.assert_array_equal(cache.get_kv(0, sid)[0][:, :2], twin.get_kv(0, sid)[0])
