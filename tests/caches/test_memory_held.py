"""Memory a cache holds while decoding stays close to what its tokens use (bounded growth).

The spare room of every growable part is bounded in tokens, not as a fraction of what is used:
the token buffers grow by at most ``max_step`` tokens (64), the float16 window and rollback
copies slide in buffers with ``SPARE_ROWS`` rows of room, the window cache's rows by at most
``max(16, keep // 16)`` rows. The bytes these tests check do not depend on the values stored.
"""

import types

import numpy as np
import pytest

import arraykv
from arraykv.caches.sliding import SPARE_ROWS
from arraykv.storage import TokenBuffers

from cache_contract import random_kvq

D = 64


def _decode(cache, rng, layers, heads, steps, groups=1):
    cfg = arraykv.AttendConfig(D**-0.5, groups)
    for _ in range(steps):
        for layer in range(layers):
            k, v, q = random_kvq(rng, np, 1, heads, groups, 1, D)
            cache.decode(layer, k, v, q, cfg)


def test_token_buffers_grow_by_at_most_max_step_tokens():
    buf = TokenBuffers()
    buf.append({"x": np.zeros((1, 1, 4000, 2), np.float32)})
    assert buf.capacity == 4000  # a prompt: exactly its tokens
    one = {"x": np.zeros((1, 1, 1, 2), np.float32)}
    for _ in range(1000):
        buf.append(one)
        assert buf.capacity - buf.length <= buf.max_step == 64
    # steps of 64 tokens: 1000 tokens appended in 16 reallocations
    assert buf.reallocations == 1 + -(-1000 // 64)


def test_token_buffers_grow_geometrically_while_small():
    buf = TokenBuffers(min_capacity=4, max_step=64)
    one = {"x": np.zeros((1, 1, 1, 2), np.float32)}
    caps = []
    for _ in range(700):
        buf.append(one)
        if buf.capacity not in caps:
            caps.append(buf.capacity)
    steps = np.diff(caps)
    assert steps.max() == 64 and steps.min() == 4
    assert all(np.diff(steps) >= 0)  # 4, 4, ..., growing by 10 %, then 64 each


def test_truncation_keeps_a_drafts_room_and_releases_more():
    buf = TokenBuffers()
    buf.append({"x": np.zeros((1, 1, 3000, 2), np.float32)})
    buf.append({"x": np.zeros((1, 1, 1, 2), np.float32)})
    cap = buf.capacity
    buf.truncate(3000 - 60)  # a rejected draft: no copy
    assert buf.capacity == cap
    buf.truncate(2000)  # far below: the spare room is released
    assert buf.capacity == 2000


@pytest.mark.parametrize("method", ["pqo4", "pqo2", "int4", "dense"])
def test_held_within_two_percent_of_used_after_a_long_prompt_and_decoding(method, rng):
    layers, heads = 2, 2
    cache = arraykv.make_cache(method, num_layers=layers, num_kv_heads=heads, head_dim=D)
    for layer in range(layers):
        cache.prefill(layer, *random_kvq(rng, np, 1, heads, 1, 4096, D))
    _decode(cache, rng, layers, heads, 100)
    rollback = cache.rollback_bytes() if method != "dense" else 0
    # rollback copies are a fixed margin (rollback_tokens), counted apart; the rest is spare room
    assert cache.memory_usage() - rollback <= 1.02 * cache.used_bytes()


def test_polar_spare_room_is_bounded_in_tokens(rng):
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=D)
    cache.prefill(0, *random_kvq(rng, np, 1, 2, 1, 2048, D))
    for steps in (1, 63, 200):
        _decode(cache, rng, 1, 2, steps)
        st = cache._states[0]
        assert st.codes.capacity - st.codes.length <= 64
        row = 2 * 2 * D * 2  # a float16 row of keys and values for 2 heads
        sliding = sum(r.spare_nbytes() for r in (st.window_rows, st.rollback_rows) if r is not None)
        assert sliding <= 2 * SPARE_ROWS * row


@pytest.mark.parametrize("storage", ["exact", "pq4"])
def test_window_cache_rows_hold_little_spare_room(storage, rng):
    window, rollback = 512, 16
    cache = arraykv.make_cache(
        "window", num_layers=1, num_kv_heads=1, head_dim=D, window=window, rollback_tokens=rollback, storage=storage
    )
    keep = window + rollback
    spare = max(16, keep // 16)
    cache.prefill(0, *random_kvq(rng, np, 1, 1, 1, 511, D))
    st = cache._states[0]
    assert int(next(iter(st.rows.values())).shape[2]) == 511  # a prompt: exactly its rows
    for _ in range(3):
        _decode(cache, rng, 1, 1, 100)
        rows = int(next(iter(st.rows.values())).shape[2])
        assert st.n == keep and rows <= keep + spare


def test_hybrid_dense_at_511_tokens_holds_little_spare_room(rng):
    layers = 6
    types = ("sliding_attention",) * 5 + ("full_attention",)
    cache = arraykv.make_cache(
        "hybrid", num_layers=layers, num_kv_heads=1, head_dim=D, layer_types=types, window=512, full_method="dense"
    )
    for layer in range(layers):
        cache.prefill(layer, *random_kvq(rng, np, 1, 1, 1, 511, D))
    assert cache.memory_usage() == cache.used_bytes()  # a prompt: every layer exactly its rows
    _decode(cache, rng, layers, 1, 100)
    # the window layers' rows: 528 kept and at most max(16, 528 // 16) = 33 spare
    assert cache.memory_usage() <= cache.used_bytes() * (1 + 33 / 528)


def _reachable_nbytes(root):
    """Bytes of the NumPy arrays reachable from ``root``, each underlying buffer once."""
    seen, owners, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None), type)) or callable(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            while isinstance(obj.base, np.ndarray):
                obj = obj.base
            owners[id(obj)] = obj
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif not isinstance(obj, types.ModuleType) and not type(obj).__module__.startswith(
            ("numpy", "threading", "_thread", "array_api")
        ):
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(
                getattr(obj, s) for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if hasattr(obj, s)
            )
    return sum(a.nbytes for a in owners.values())


@pytest.mark.parametrize(
    "method, options",
    [("window", {"window": 64, "storage": "pq5"}), ("window", {"window": 64}), ("pqo4", {}), ("int4", {})],
)
def test_memory_usage_counts_every_array_held(method, options, rng):
    cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=1, head_dim=D, **options)
    for layer in range(2):
        cache.prefill(layer, *random_kvq(rng, np, 1, 1, 1, 100, D))
    _decode(cache, rng, 2, 1, 3)
    assert _reachable_nbytes(cache) <= cache.memory_usage()
