import threading

import numpy as np
import pytest

import arraykv
from arraykv import Hybrid, KVCacheCompressor, LowRank, PagedKVCache

from conftest import asarray, to_np

H, D = 2, 8


def make(**kw):
    opts = dict(num_layers=2, num_kv_heads=H, head_dim=D, block_size=4, num_blocks=10)
    opts.update(kw)
    return PagedKVCache(**opts)


def tok(rng, xp, t):
    return (
        asarray(xp, rng.standard_normal((H, t, D)).astype(np.float32)),
        asarray(xp, rng.standard_normal((H, t, D)).astype(np.float32)),
    )


def test_write_then_read_exact_for_sequences_of_different_lengths(xp, rng):
    cache = make()
    a, b = cache.allocate_sequence(), cache.allocate_sequence()
    want = {a: [], b: []}
    for sid, steps in ((a, (3, 1, 5)), (b, (6,)), (a, (2,))):
        for t in steps:
            k, v = tok(rng, xp, t)
            cache.append(1, sid, k, v)
            want[sid].append((to_np(k), to_np(v)))
    for sid in (a, b):
        k, v = cache.get_kv(1, sid)
        np.testing.assert_array_equal(to_np(k), np.concatenate([w[0] for w in want[sid]], axis=1))
        np.testing.assert_array_equal(to_np(v), np.concatenate([w[1] for w in want[sid]], axis=1))
    assert cache.seq_len(1, a) == 11 and cache.seq_len(1, b) == 6 and cache.seq_len(0, a) == 0
    assert len(cache.block_table(1, a)) == 3 and len(cache.block_table(1, b)) == 2
    kb, vb, lengths = cache.get_batch(1, [a, b])
    assert lengths == [11, 6] and kb.shape == (2, H, 11, D)
    np.testing.assert_array_equal(to_np(kb)[1, :, :6], to_np(cache.get_kv(1, b)[0]))
    assert np.all(to_np(kb)[1, :, 6:] == 0)
    per_block = 2 * H * 4 * D * 4
    assert cache.memory_usage() == 5 * per_block
    assert cache.free_blocks(1) == 5 and cache.free_blocks(0) == 10


def test_out_of_blocks_writes_nothing(xp, rng):
    cache = make(num_blocks=3)
    a, b = cache.allocate_sequence(), cache.allocate_sequence()
    cache.append(0, a, *tok(rng, xp, 9))  # 3 blocks
    before = to_np(cache.get_kv(0, a)[0])
    with pytest.raises(ValueError, match="free blocks"):
        cache.append(0, a, *tok(rng, xp, 4))
    with pytest.raises(ValueError, match="nothing was written"):
        cache.append(0, b, *tok(rng, xp, 1))
    np.testing.assert_array_equal(to_np(cache.get_kv(0, a)[0]), before)
    assert cache.seq_len(0, a) == 9 and cache.seq_len(0, b) == 0 and cache.free_blocks(0) == 0
    cache.append(0, a, *tok(rng, xp, 3))  # fills the last block's free slots
    cache.free(a)
    assert cache.free_blocks(0) == 3
    cache.append(0, b, *tok(rng, xp, 12))


def test_free_errors_and_reuse():
    cache = make()
    a = cache.allocate_sequence()
    cache.free(a)
    with pytest.raises(ValueError, match="already freed"):
        cache.free(a)
    with pytest.raises(ValueError, match="never allocated"):
        cache.free(99)
    k = np.zeros((H, 1, D), np.float32)
    with pytest.raises(ValueError, match="was freed"):
        cache.append(0, a, k, k)
    with pytest.raises(ValueError, match="never allocated"):
        cache.get_kv(0, 7)
    with pytest.raises(ValueError, match="was freed"):
        cache.seq_len(0, a)
    assert cache.allocate_sequence() != a


def test_bad_input(rng):
    cache = make()
    s = cache.allocate_sequence()
    k = rng.standard_normal((H, 2, D)).astype(np.float32)
    nan = k.copy()
    nan[0, 0, 0] = np.nan
    for args, exc in [
        ((k[0], k), ValueError),
        ((k, k[:, :1]), ValueError),
        ((k.astype(np.int32),) * 2, TypeError),
        ((k, k.astype(np.float64)), TypeError),
        ((nan, k), ValueError),
        ((k.tolist(), k), TypeError),
        ((k[:, :, :3], k), ValueError),
        ((k[:1], k[:1]), ValueError),
    ]:
        with pytest.raises(exc):
            cache.append(0, s, *args)
    assert cache.seq_len(0, s) == 0
    cache.append(0, s, k, k)
    with pytest.raises(TypeError, match="dtype"):
        cache.append(0, s, k.astype(np.float64), k.astype(np.float64))
    with pytest.raises(ValueError, match="layer"):
        cache.append(2, s, k, k)
    with pytest.raises(ValueError, match="block_size"):
        make(block_size=0)
    with pytest.raises(ValueError, match="no tokens"):
        cache.get_kv(1, s)


def test_thread_safety(rng):
    cache = make(num_layers=2, num_blocks=400, block_size=3)
    ids = [cache.allocate_sequence() for _ in range(8)]
    data = {sid: rng.standard_normal((H, 40, D)).astype(np.float32) for sid in ids}
    errors = []

    def worker(sid):
        try:
            for layer in (0, 1):
                for i in range(0, 40, 5):
                    cache.append(layer, sid, data[sid][:, i : i + 5], -data[sid][:, i : i + 5])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for sid in ids:
        for layer in (0, 1):
            k, v = cache.get_kv(layer, sid)
            np.testing.assert_array_equal(k, data[sid])
            np.testing.assert_array_equal(v, -data[sid])


def test_bridges_round_trip(xp, rng):
    cache = make(num_blocks=40)
    s = cache.allocate_sequence()
    cache.append(0, s, *tok(rng, xp, 30))
    comp = KVCacheCompressor(LowRank(rank=D))
    c = arraykv.compress_paged_cache(comp, cache, 0, s)
    assert c.layout == "hsd" and c.shape == (H, 30, D)
    t = cache.allocate_sequence()
    arraykv.decompress_to_paged_cache(comp, c, cache, 0, t)
    np.testing.assert_allclose(to_np(cache.get_kv(0, t)[0]), to_np(cache.get_kv(0, s)[0]), atol=1e-4)
    hy = KVCacheCompressor(Hybrid(rank=4, quant_bits=8))
    u = cache.allocate_sequence()
    hy.decompress_to_paged_cache(hy.compress_paged_cache(cache, 0, s), cache, 0, u)
    assert cache.seq_len(0, u) == 30
