"""Cache transactions: a step over several layers that fails anywhere leaves every layer exactly as
it was (lengths, arrays, calibration, windows, rollback copies, the cache-wide rotations), at any
length, and the same step run again gives what an uninterrupted run gives, bit for bit.

A "step" is what an engine does for one chunk or one token: one store call per layer, in layer
order, inside ``cache.transaction()``. A :class:`~interrupts.FailingCache` makes store call ``k``
fail (before the cache, inside it once the tokens are stored, or after it returned) for every
``k``, with ``MemoryError`` and ``KeyboardInterrupt``.
"""

from __future__ import annotations

import numpy as np
import pytest
from interrupts import MODES, FailingCache, assert_same_state, cache_state

import arraykv
from arraykv import AttendConfig
from arraykv.caches.transaction import CopyUndo, FieldUndo

L, H, D, G = 3, 2, 32, 2
TYPES = ("sliding_attention", "full_attention", "sliding_attention")


def _tokens(seed: int, t: int) -> tuple:
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((1, H, t, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, H * G, t, D)).astype(np.float32)
    return k, v, q


def _factories() -> dict:
    out = {
        m: (lambda m=m, **o: arraykv.make_cache(m, num_layers=L, num_kv_heads=H, head_dim=D, **o))
        for m in arraykv.available_methods()
    }
    for storage in ("float16", "pq4"):
        out[f"window-{storage}"] = lambda s=storage, **o: arraykv.make_cache(
            "window", num_layers=L, num_kv_heads=H, head_dim=D, window=12, storage=s, **o
        )
    for full in ("pqo4", "int4"):
        out[f"hybrid-{full}"] = lambda f=full, **o: arraykv.make_cache(
            "hybrid",
            num_layers=L,
            num_kv_heads=H,
            head_dim=D,
            layer_types=TYPES,
            window=12,
            full_method=f,
            full_options=o,
        )
    return out


FACTORIES = _factories()


def _prefill_step(seed: int, t: int):
    k, v, q = _tokens(seed, t)

    def step(cache):
        with cache.transaction():
            return [np.array(cache.prefill(i, k, v, q).k) for i in range(L)]

    return step


def _append_step(seed: int, t: int):
    k, v, q = _tokens(seed, t)

    def step(cache):
        with cache.transaction():
            for i in range(L):
                cache.append(i, k, v, q)
        return [np.array(cache.dequantize(i).v) for i in range(L)]

    return step


def _decode_step(seed: int):
    k, v, q = _tokens(seed, 1)
    config = AttendConfig(softmax_scale=D**-0.5, n_kv_groups=G)

    def step(cache):
        with cache.transaction():
            outs = [cache.decode(i, k, v, q, config) for i in range(L)]
        return [np.array(o.output if hasattr(o, "output") else o.result.k) for o in outs]

    return step


def _filled(make, tokens: int = 30):
    cache = make()
    if tokens:
        _prefill_step(0, tokens)(cache)
    return cache


def _check_every_failure(make, step, tokens: int = 30) -> None:
    ref = _filled(make, tokens)
    before = cache_state(ref, L)
    want = step(ref)
    after = cache_state(ref, L)
    for k in range(L):
        for j, mode in enumerate(MODES):
            exc = (MemoryError, KeyboardInterrupt)[(k + j) % 2]
            cache = _filled(make, tokens)
            failing = FailingCache(cache, at=k, exc=exc, mode=mode)
            with pytest.raises(exc, match="injected"):
                step(failing)
            failing.restore_cache()
            what = f"layer {k}, {mode}, {exc.__name__}"
            assert_same_state(cache_state(cache, L), before, what)
            got = step(cache)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b, err_msg=f"re-run after {what}")
            assert_same_state(cache_state(cache, L), after, f"re-run after {what}")


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_step_failing_in_any_layer_leaves_every_layer_as_it_was(name):
    make = FACTORIES[name]
    for step in (_prefill_step(1, 40), _decode_step(2), _append_step(3, 5)):
        _check_every_failure(make, step)


@pytest.mark.parametrize("name", ["pqo4", "int4", "lowrank", "window-pq4", "hybrid-pqo4"])
def test_without_a_rollback_margin_and_from_an_empty_cache(name):
    make = lambda: FACTORIES[name](rollback_tokens=0)  # noqa: E731
    _check_every_failure(make, _prefill_step(1, 40))
    _check_every_failure(make, _decode_step(2))
    _check_every_failure(FACTORIES[name], _prefill_step(1, 40), tokens=0)  # the rotations made on first use go too


@pytest.mark.parametrize("name", ["pqo4", "int4", "vq", "dense", "window-pq4"])
def test_a_single_call_failing_inside_a_layer_leaves_it_exactly_as_it_was(name):
    """No transaction: the call's own record puts the layer back, rollback copies included (a
    truncation by the call's tokens used to drop the oldest copy)."""
    k, v, q = _tokens(5, 1)
    config = AttendConfig(softmax_scale=D**-0.5, n_kv_groups=G)
    for tokens in (60, 30):
        cache = _filled(FACTORIES[name], tokens)
        for _ in range(20):  # the window full and spilling: every decode encodes a token
            cache.decode(0, k, v, q, config)
        before = cache_state(cache, L)
        failing = FailingCache(cache, at=0, exc=KeyboardInterrupt, mode="inside")
        with pytest.raises(KeyboardInterrupt):
            failing.decode(0, k, v, q, config)
        failing.restore_cache()
        assert_same_state(cache_state(cache, L), before, f"{tokens} tokens")


def test_nested_transactions_roll_back_to_their_own_start():
    cache = _filled(FACTORIES["pqo4"])
    step1, step2 = _prefill_step(7, 20), _prefill_step(8, 3)
    start = cache_state(cache, L)
    with cache.transaction():
        step1(cache)
        middle = cache_state(cache, L)
        with pytest.raises(MemoryError):
            with cache.transaction():
                step2(cache)
                raise MemoryError
        assert_same_state(cache_state(cache, L), middle, "inner rollback")
    assert_same_state(cache_state(cache, L), middle, "outer commit")
    with pytest.raises(KeyboardInterrupt):
        with cache.transaction():
            step2(cache)  # a transaction of its own, committed inside the outer one
            raise KeyboardInterrupt
    assert_same_state(cache_state(cache, L), middle, "outer rollback")
    assert start != middle


@pytest.mark.parametrize("name", ["pqo4", "int4", "dense", "window-pq4", "hybrid-int4"])
def test_truncate_reset_restore_and_appends_inside_a_transaction_are_rolled_back(name):
    """A truncation then appends rewrite rows that the records hold: they are copied first."""

    def filled():
        cache = _filled(FACTORIES[name], 40)
        _prefill_step(12, 10)(cache)  # truncations within this call are exact
        return cache

    cache = filled()
    before = cache_state(cache, L)
    k, v, q = _tokens(9, 6)
    txn = cache.begin_transaction()
    cache.prefill(1, k, v, q)
    cache.truncate_all(46)
    for i in range(L):
        cache.append(i, k, v, q)  # writes the rows 46 .. 51 that the records point at
    cache.truncate(2, 0)
    cache.reset()
    _prefill_step(10, 5)(cache)
    cache.restore(_filled(FACTORIES[name], 20).snapshot())
    txn.rollback()
    txn.rollback()  # ended: nothing to do
    assert not txn.open
    assert_same_state(cache_state(cache, L), before, name)
    want = _decode_step(11)(filled())
    for a, b in zip(_decode_step(11)(cache), want):
        np.testing.assert_array_equal(a, b)


def test_a_commit_keeps_every_call_and_the_records_are_the_layers_fields():
    """The caches record their fields by reference (no copy of the token buffers); a layer state
    that does not say how it may be restored (``undo = "copy"``) is copied."""
    for name, kind in (("pqo4", FieldUndo), ("int4", FieldUndo), ("dense", FieldUndo), ("window-pq4", FieldUndo)):
        cache = _filled(FACTORIES[name])
        txn = cache.begin_transaction()
        _decode_step(1)(cache)
        assert sorted(txn.records) == list(range(L)) and all(isinstance(r, kind) for r in txn.records.values())
        state = cache_state(cache, L)
        txn.commit()
        assert txn.records == {} and not txn.open
        assert_same_state(cache_state(cache, L), state, name)
    from dataclasses import dataclass, fields

    from arraykv.caches.dense import DenseCache, DenseLayer

    @dataclass
    class OwnLayer(DenseLayer):
        undo = "copy"  # type: ignore[misc]  # a third party's state: nothing promised

    class OwnCache(DenseCache):
        def _new_layer(self, xp, dev, batch, dtype):
            st = super()._new_layer(xp, dev, batch, dtype)
            return OwnLayer(**{f.name: getattr(st, f.name) for f in fields(st)})

    own = OwnCache(num_layers=L, num_kv_heads=H, head_dim=D)
    _prefill_step(0, 30)(own)
    before = cache_state(own, L)
    txn = own.begin_transaction()
    _decode_step(1)(own)
    assert all(isinstance(r, CopyUndo) for r in txn.records.values())
    txn.rollback()
    assert_same_state(cache_state(own, L), before, "copied layers")
    hybrid = _filled(FACTORIES["hybrid-pqo4"])
    txn = hybrid.begin_transaction()
    _decode_step(1)(hybrid)
    assert txn.layers == [0, 1, 2] and txn.full.layers == [1] and txn.sliding.layers == [0, 2]
    txn.commit()
    assert not txn.open


def test_a_transaction_holds_the_calls_of_its_own_thread_only():
    """Two threads writing different layers (a draft and a verifier): one thread's rollback puts
    back its own layer and leaves the other thread's write, made meanwhile, in place."""
    import threading

    cache = _filled(FACTORIES["pqo4"])
    k, v, q = _tokens(13, 20)
    before = cache_state(cache, L)
    other_done = threading.Event()

    def other():
        cache.prefill(1, k, v, q)  # no transaction of its own
        other_done.set()

    with pytest.raises(KeyboardInterrupt):
        with cache.transaction() as txn:
            cache.prefill(0, k, v, q)
            worker = threading.Thread(target=other)
            worker.start()
            worker.join()
            assert other_done.is_set() and txn.layers == [0]
            raise KeyboardInterrupt
    got = cache_state(cache, L)
    assert [n for n, _ in got[0]] == [30, 50, 30]
    assert_same_state(([got[0][0]], got[1], 0), ([before[0][0]], before[1], 0), "layer 0 put back")
    assert cache._transactions == {}
