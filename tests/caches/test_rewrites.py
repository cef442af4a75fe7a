"""``rewrites``: what a reader keeping a layer's K/V checks besides ``seq_len``.

Stores of new tokens (and stores refused and put back) leave the count; every change of the
tokens already held (reset, truncation, a rolled-back transaction, restore, select_rows) adds
to it, so a kept read is never reused for a cache truncated and refilled to the same length.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv.protocol import INCREMENTAL, supports

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=32)
CASES = {
    "dense": {},
    "pqo4": {},
    "int4": {},
    "tq3": {},
    "lowrank": {},
    "window": dict(window=8),
    "hybrid": dict(layer_types=["sliding_attention", "full_attention"], window=8, full_method="pqo4"),
}


def _make(name):
    return arraykv.make_cache(name, **GEOM, **CASES[name])


def _kvq(t, seed):
    r = np.random.default_rng(seed)
    return (
        r.standard_normal((1, 2, t, 32)).astype(np.float32),
        r.standard_normal((1, 2, t, 32)).astype(np.float32),
        r.standard_normal((1, 4, t, 32)).astype(np.float32),
    )


def _fill(cache, t=40, seed=0):
    for layer in range(GEOM["num_layers"]):
        cache.prefill(layer, *_kvq(t, seed + layer))


@pytest.mark.parametrize("name", list(CASES))
def test_stores_leave_the_count_and_every_rewrite_adds_to_it(name):
    if name not in arraykv.available_methods(generic=True):
        pytest.skip(f"{name} is not registered")
    cache = _make(name)
    assert supports(cache, INCREMENTAL) and cache.rewrites == 0
    _fill(cache)
    cache.append(0, *_kvq(3, 7))
    cache.append(1, *_kvq(3, 8))
    k, v, q = _kvq(1, 9)
    cache.decode(0, k, v, q, arraykv.AttendConfig(softmax_scale=32**-0.5, n_kv_groups=2))
    bad = _kvq(1, 10)
    bad[0][..., 0] = np.nan
    with pytest.raises(ValueError):
        cache.prefill(1, *bad)  # refused, put back as it was: not a rewrite
    with cache.transaction():
        cache.append(1, *_kvq(1, 11))  # committed: a store
    assert cache.rewrites == 0

    seen = [cache.rewrites]

    def changed(what):
        assert cache.rewrites > seen[-1], f"{name}: {what} left rewrites at {cache.rewrites}"
        seen.append(cache.rewrites)

    saved = cache.snapshot()
    n = cache.seq_len(1)
    cache.truncate_all(n - 1)
    changed("truncate_all")
    cache.truncate(0, cache.seq_len(0) - 1)
    changed("truncate")
    txn = cache.begin_transaction()
    cache.append(0, *_kvq(1, 12))
    txn.rollback()
    changed("a rolled-back transaction")
    cache.restore(saved)
    changed("restore")
    cache.select_rows([0])
    changed("select_rows")
    cache.reset()
    changed("reset")


def test_a_kept_read_of_a_cache_truncated_and_refilled_is_not_reused():
    """The count tells apart two states of one length: refilled with other tokens."""
    cache = _make("pqo4")
    _fill(cache)
    for layer in range(GEOM["num_layers"]):
        cache.append(layer, *_kvq(2, 40 + layer))
    kept = (cache.seq_len(0), cache.rewrites)
    cache.truncate_all(41)
    for layer in range(GEOM["num_layers"]):
        cache.append(layer, *_kvq(1, 50 + layer))
    assert cache.seq_len(0) == kept[0] and cache.rewrites != kept[1]
