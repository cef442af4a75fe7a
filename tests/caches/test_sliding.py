"""Window blocks slid in place (:mod:`arraykv.caches.sliding`) against the concatenating store.

Every store of a window cache (polar, ``lowrank``, ``vq``) that takes no sink slides its float16
window and rollback copies in place (``window.commit_store``); a polar layer whose sinks and
window are full stores a decode token in one op (``PolarCache._slide_one``). Everything such a
cache holds and answers must be what a cache that builds every block by concatenation gives,
bit for bit: the arrays, the decode output, a refused store, truncation, fork and save/load
afterwards.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import arraykv
from arraykv.caches import window
from arraykv.caches.polar import PolarCache
from arraykv.caches.sliding import SlidingRows

from cache_contract import random_kvq

H, G, D = 2, 2, 16
CFG = arraykv.AttendConfig(n_kv_groups=G, softmax_scale=0.25)


@pytest.mark.parametrize("head", [0, 1, 3])
def test_slide_equals_concatenation(rng, head):
    k = rng.standard_normal((1, 2, 6, 3)).astype(np.float16)
    rows = SlidingRows(np, k, k + 1, spare=3)
    ref_k, ref_v = k.copy(), k + 1
    for _ in range(60):
        drop = int(rng.integers(0, 3)) if int(ref_k.shape[2]) >= head + 2 else 0
        t = int(rng.integers(0, 3))
        nk = rng.standard_normal((1, 2, t, 3)).astype(np.float16)
        ref_k = np.concatenate([ref_k[:, :, :head], ref_k[:, :, head + drop :], nk], axis=2)
        ref_v = np.concatenate([ref_v[:, :, :head], ref_v[:, :, head + drop :], nk - 1], axis=2)
        got_k, got_v = rows.slide(head, drop, nk, nk - 1)
        assert rows.holds(got_k) and not rows.holds(ref_k)
        np.testing.assert_array_equal(got_k, ref_k)
        np.testing.assert_array_equal(got_v, ref_v)
        assert rows.spare_nbytes() >= 0


def _pair(method, **options):
    """The same cache twice: the second builds every block by concatenation (calls on it inside
    :func:`_mode`)."""
    fast = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, **options)
    slow = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, **options)
    slow._slide_one = lambda *args: False
    slow._concatenates = True
    return fast, slow


@contextlib.contextmanager
def _mode(cache):
    """Calls on a cache of :func:`_pair` made to concatenate store every block anew."""
    if not getattr(cache, "_concatenates", False):
        yield
        return
    sliding = window._sliding_block
    window._sliding_block = window._new_block
    try:
        yield
    finally:
        window._sliding_block = sliding


def _output(res):
    """The attention output of a decode answer (fused, or over what a dequantized one returns)."""
    if isinstance(res, arraykv.Fused):
        return res.output
    return res.result.k, res.result.v, res.result.logit_bias


def _same(a, b):
    xa, xb = a.layer_arrays(0), b.layer_arrays(0)
    assert xa.keys() == xb.keys()
    for name in xa:
        np.testing.assert_array_equal(xa[name], xb[name], err_msg=name)
    assert a.seq_len(0) == b.seq_len(0) and a.used_bytes() == b.used_bytes()
    assert a.rollback_bytes() == b.rollback_bytes()


@pytest.mark.parametrize(
    "method,options",
    [
        ("pqo4", {}),
        ("pqo2", {"residual_window": 3, "sink_tokens": 0, "rollback_tokens": 2}),
        ("tq3", {"residual_window": 5, "sink_tokens": 2, "rollback_tokens": 0}),
        ("pqo3", {"residual_window": 1, "sink_tokens": 1, "rollback_tokens": 7}),
        ("pqo4", {"outliers": 2, "residual_window": 4}),
        ("tq3", {"outliers": 1, "residual_window": 2, "sink_tokens": 3}),
    ],
)
@pytest.mark.parametrize("kernels", [True, False])
def test_in_place_store_holds_and_answers_what_concatenation_does(rng, method, options, kernels):
    """With kernels on, the step is one compiled op; off, its array-API reference: either way the
    same state as the general store."""
    if not kernels:
        with arraykv.ops.set_kernels_enabled(False):
            _in_place_equals_concatenation(rng, method, options)
    else:
        _in_place_equals_concatenation(rng, method, options)


def _in_place_equals_concatenation(rng, method, options, first=40):
    fast, slow = _pair(method, **options)
    k, v, q = random_kvq(rng, np, 1, H, G, first, D)
    for c in (fast, slow):
        with _mode(c):
            c.prefill(0, k, v, q)
    for step in range(90):
        k, v, q = random_kvq(rng, np, 1, H, G, 1 + (step % 7 == 3), D)  # now and then two tokens
        if step % 17 == 5:  # a refused store changes neither
            k = k.copy()
            k[0, 0, -1, 0] = 1e6
            for c in (fast, slow):
                with _mode(c), pytest.raises(ValueError, match="overflow"):
                    c.decode(0, k, v, q, CFG) if int(k.shape[2]) == 1 else c.prefill(0, k, v, q)
            _same(fast, slow)
            continue
        outs = []
        for c in (fast, slow):
            with _mode(c):
                outs.append(_output(c.decode(0, k, v, q, CFG)) if int(k.shape[2]) == 1 else c.prefill(0, k, v, q))
        if int(k.shape[2]) == 1:
            np.testing.assert_equal(outs[0], outs[1])
        else:
            np.testing.assert_equal((outs[0].k, outs[0].v), (outs[1].k, outs[1].v))
        _same(fast, slow)
        if step % 23 == 11:  # a truncation, then the window slides again
            n = fast.min_truncate_length(0)
            length = int(rng.integers(n, fast.seq_len(0) + 1))
            for c in (fast, slow):
                c.truncate(0, length)
            _same(fast, slow)
        if step % 29 == 13:  # a longer chunk in between
            k, v, q = random_kvq(rng, np, 1, H, G, 3, D)
            for c in (fast, slow):
                with _mode(c):
                    c.prefill(0, k, v, q)
            _same(fast, slow)
    assert fast._states[0].window_rows is not None and slow._states[0].window_rows is None  # both paths ran
    twin = fast.fork()
    _same(twin, slow)
    k, v, q = random_kvq(rng, np, 1, H, G, 1, D)
    outs = []
    for c in (twin, fast, slow):
        with _mode(c):
            outs.append(_output(c.decode(0, k, v, q, CFG)))
    np.testing.assert_equal(outs[0], outs[2])
    np.testing.assert_equal(outs[1], outs[2])
    _same(twin, slow)


@pytest.mark.parametrize(
    "method,options",
    [
        ("lowrank", {"rank": 4, "min_calibration": 16}),
        ("lowrank", {"rank": 6, "min_calibration": 16, "residual_window": 3, "sink_tokens": 0, "rollback_tokens": 2}),
        ("vq", {"codebook_size": 16, "sub_dim": 4, "min_calibration": 16, "residual_window": 5, "sink_tokens": 2}),
        ("vq", {"codebook_size": 8, "sub_dim": 2, "min_calibration": 16, "residual_window": 1, "rollback_tokens": 7}),
    ],
)
def test_fitted_caches_slide_what_concatenation_builds(rng, method, options):
    """lowrank and vq: every store without a new sink slides in place (the general store)."""
    _in_place_equals_concatenation(rng, method, options)


def test_spare_rows_are_counted_in_memory_usage_only(rng):
    c = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=H, head_dim=D)
    k, v, q = random_kvq(rng, np, 1, H, G, 64, D)
    c.prefill(0, k, v, q)
    for _ in range(3):
        k, v, q = random_kvq(rng, np, 1, H, G, 1, D)
        c.decode(0, k, v, q, CFG)
    st = c._states[0]
    assert isinstance(c, PolarCache) and st.window_rows is not None and st.rollback_rows is not None
    spare = st.window_rows.spare_nbytes() + st.rollback_rows.spare_nbytes()
    assert spare > 0
    codes_spare = sum(b.reserved_nbytes() - b.used_nbytes() for b in st.buffers())
    assert c.memory_usage() - c.used_bytes() == c.rollback_bytes() + codes_spare + spare


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_in_place_store_of_other_input_dtypes_is_the_general_store(rng, dtype):
    """float16 tokens take the one-call store (exact in float32); float64 ones the general path
    (rounding through float32 first could differ): both hold what concatenation holds."""
    fast, slow = _pair("pqo4", residual_window=4, sink_tokens=2)
    k, v, q = (a.astype(dtype) for a in random_kvq(rng, np, 1, H, G, 30, D))
    for c in (fast, slow):
        with _mode(c):
            c.prefill(0, k, v, q)
    one_call = []
    store = arraykv.ops.polar_store_token

    def counted(*args):
        one_call.append(1)
        return store(*args)

    for _ in range(25):
        k, v, q = (a.astype(dtype) for a in random_kvq(rng, np, 1, H, G, 1, D))
        outs = []
        for c in (fast, slow):
            with _mode(c):
                arraykv.ops.polar_store_token = counted
                try:
                    outs.append(_output(c.decode(0, k, v, q, CFG)))
                finally:
                    arraykv.ops.polar_store_token = store
        np.testing.assert_equal(outs[0], outs[1])
        _same(fast, slow)
    assert bool(one_call) == (dtype == np.float16)
