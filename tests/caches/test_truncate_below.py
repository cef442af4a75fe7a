"""Truncations below the call that calibrated a layer (the part of the truncate tests that
``test_truncate.py`` leaves out): a short prompt, then decodes, appends and prefills during
which the layer calibrates (the polar calibration, the ``lowrank``/``vq`` fit, the int units),
then a cut at or below the start of that call.

Where the direct build of the shorter sequence has not calibrated yet and every token it holds
is still held exactly (sinks, window, rollback copies), a window cache goes back to that
uncalibrated layer; elsewhere the cut is refused. Either way :meth:`can_truncate` says which
beforehand, :meth:`min_truncate_length` stays the floor of the lengths reachable from the top,
and a truncated cache equals the direct build bit for bit (arrays, K/V, stable length, bytes,
the next decode and prefill, the saved file).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, strategies as st
from test_truncate import (
    LAYERS,
    METHODS,
    ROLLBACK,
    SETTINGS,
    assert_next_calls_same,
    assert_same,
    cut,
    make,
    replay,
    run,
    tokens,
)

import arraykv

CALLS = st.lists(
    st.tuples(st.sampled_from(["decode", "decode", "append", "prefill"]), st.integers(1, 9)), min_size=1, max_size=10
)


def _lengths(cache, layer):
    n = cache.seq_len(layer)
    return [length for length in range(n + 1) if cache.can_truncate(layer, length)]


def _check_reach(cache, layer):
    """can_truncate agrees with truncate on every length, and min_truncate_length is the floor
    of the interval that ends at seq_len."""
    n = cache.seq_len(layer)
    ok = _lengths(cache, layer)
    low = cache.min_truncate_length(layer)
    assert 0 in ok and n in ok
    assert all(length in ok for length in range(max(low, 1), n + 1))
    assert low <= 1 or low - 1 not in ok
    for length in range(1, min(n, low + 2)):  # the lengths below the floor, and at it
        twin = cache.fork()
        if length in ok:
            twin.truncate(layer, length)
            assert twin.seq_len(layer) == length
        else:
            with pytest.raises(ValueError, match="rollback_tokens|calibrated"):
                twin.truncate(layer, length)
            assert twin.seq_len(layer) == n
    assert not cache.can_truncate(layer, n + 1)
    return ok, low


@pytest.mark.parametrize("method", sorted(METHODS))
@SETTINGS
@given(
    prompt=st.integers(1, 30),
    calls=CALLS,
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**31),
    pick=st.floats(0.0, 1.0),
    everywhere=st.booleans(),
)
def test_cuts_below_the_calibrating_call_match_the_direct_build(
    method, prompt, calls, batch, seed, pick, everywhere, tmp_path_factory
):
    rng = np.random.default_rng(seed)
    cache = make(method)
    histories = [[] for _ in range(LAYERS)]
    for layer in range(LAYERS):
        for i, (kind, t) in enumerate([("prefill", prompt)] + calls):
            if layer == 1 and i % 3 == 2:  # the layers differ a little
                continue
            call = (kind, *tokens(rng, batch, 1 if kind == "decode" else t))
            run(cache, layer, call)
            histories[layer].append(call)
    ok, low = _check_reach(cache, 0)
    below = [length for length in ok if 0 < length < low]
    event("a cut below the calibrating call" if below else "no length below the floor")
    choices = below or ok
    length = choices[min(len(choices) - 1, int(pick * len(choices)))]
    if everywhere and cache.can_truncate(1, min(length, cache.seq_len(1))):
        cache.truncate_all(length)
        for i in range(LAYERS):
            histories[i] = cut(histories[i], min(length, sum(c[1].shape[2] for c in histories[i])))
    else:
        cache.truncate(0, length)
        histories[0] = cut(histories[0], length)
    direct = replay(method, histories)
    assert_same(cache, direct)
    if below:  # back before the calibrating call: no copy is left, nor a record of the call
        assert cache.layer_arrays(0)["fixed_end"][0] == 0
        for name in ROLLBACK:
            assert cache.layer_arrays(0)[name].shape[2] == 0
    _check_reach(cache, 0)
    assert_next_calls_same(cache, direct, rng, batch)
    for kind, t in calls[:4]:  # and later calls calibrate as the direct build does
        call = (kind, *tokens(rng, batch, 1 if kind == "decode" else t))
        run(cache, 0, call)
        run(direct, 0, call)
    assert_same(cache, direct, rollback_suffix=not below)
    path = tmp_path_factory.mktemp("files") / "c.akv"
    cache.save(path)
    back = arraykv.load(path)
    assert_same(back, cache, rollback_suffix=False)


def _short_prompt(method, rng, prompt=16, decodes=13, **extra):
    cache = make(method, **extra)
    calls = [("prefill", *tokens(rng, 1, prompt))] + [("decode", *tokens(rng, 1, 1)) for _ in range(decodes)]
    for call in calls:
        run(cache, 0, call)
    return cache, calls


@pytest.mark.parametrize("method", ["pqo4", "tq3", "pq2"])
def test_a_speculative_block_that_calibrated_is_taken_back(method):
    """pqo4 (4 sinks, 20-token window): a 16-token prompt, decodes at 16 .. 28; the decode at 24
    spills the first token and calibrates. Every length is reachable, 22 (inside the window of a
    layer that never spilled) gives the uncalibrated layer of the prompt and 6 decodes."""
    rng = np.random.default_rng(11)
    cache, calls = _short_prompt(method, rng)
    window = cache.residual_window
    assert cache.layer_arrays(0)["fixed_end"][0] == 4 + window + 1
    assert cache.min_truncate_length(0) == 1
    cache.truncate_all(22)
    direct = replay(method, [cut(calls, 22), []])
    assert_same(cache, direct, rollback_suffix=False)
    assert cache.layer_arrays(0).keys() == direct.layer_arrays(0).keys()
    assert cache.stable_length(0) == 4 and cache.rollback_bytes() == direct.rollback_bytes()
    for call in calls[7:]:  # the same decodes again: the layer calibrates where it did
        run(cache, 0, call)
        run(direct, 0, call)
    assert_same(cache, direct, rollback_suffix=False)


def test_deeper_than_the_copies_or_a_calibrating_direct_build_is_refused():
    rng = np.random.default_rng(12)
    cache, _ = _short_prompt("pqo4", rng, prompt=16, decodes=13, rollback_tokens=2)
    # 5 tokens encoded, 2 copies: the prompt's uncalibrated layer is gone past the sinks
    assert _lengths(cache, 0) == [0, 1, 2, 3, 4, 27, 28, 29]
    assert cache.min_truncate_length(0) == 27
    with pytest.raises(ValueError, match=r"can reach 0, 1 \.\. 4 or 27 \.\. 29.*rollback_tokens=2"):
        cache.truncate(0, 20)
    cache.truncate(0, 3)  # the sinks alone: always exact
    assert cache.layer_arrays(0)["fixed_end"][0] == 0
    big = make("pqo4")
    k, v, q = tokens(rng, 1, 30)
    big.prefill(0, k, v, q)  # calibrated by a prompt longer than the window: 25 .. 29 calibrate
    assert _lengths(big, 0) == list(range(0, 25)) + [30]
    with pytest.raises(ValueError, match="calibrate on other tokens"):
        big.truncate(0, 27)
    big.truncate(0, 24)
    direct = make("pqo4")
    direct.prefill(0, k[:, :, :24], v[:, :, :24], q[:, :, :24])
    assert_same(big, direct, rollback_suffix=False)


def test_a_fit_by_a_call_is_undone_but_a_given_or_unrecorded_one_is_not():
    rng = np.random.default_rng(13)
    cache, calls = _short_prompt("lowrank", rng, prompt=10, decodes=20)  # fits at 16 vectors besides the sinks
    assert cache.is_fitted(0) and cache.can_truncate(0, 19)
    cache.truncate(0, 19)
    assert not cache.is_fitted(0)
    assert_same(cache, replay("lowrank", [cut(calls, 19), []]), rollback_suffix=False)
    # a file written before the record existed: the fit may have been given, so it stays
    fitted, _ = _short_prompt("lowrank", rng, prompt=10, decodes=20)
    records = fitted.snapshot()
    old = [
        None
        if r is None
        else type(r)(
            length=r.length,
            batch=r.batch,
            dtype=r.dtype,
            arrays={n: a for n, a in r.arrays.items() if n != "fixed_end"},
        )
        for r in records
    ]
    back = make("lowrank")
    back.restore(old)
    for twin in (back, back.fork()):
        assert _lengths(twin, 0) == [0, 30]
        with pytest.raises(ValueError, match="does not record"):
            twin.truncate(0, 19)
        assert "fixed_end" not in twin.layer_arrays(0)
    # polar: only a spill calibrates, so the record is not needed; an old file has no copies
    # either, so its prompt's uncalibrated layer is gone past the sinks
    polar, calls = _short_prompt("pqo4", rng, prompt=10, decodes=20)
    back = make("pqo4")
    back.restore(
        [
            None
            if r is None
            else type(r)(
                length=r.length,
                batch=r.batch,
                dtype=r.dtype,
                arrays={n: a for n, a in r.arrays.items() if n not in ROLLBACK + ("fixed_end",)},
            )
            for r in polar.snapshot()
        ]
    )
    assert _lengths(back, 0) == [0, 1, 2, 3, 4, 30]
    back.truncate(0, 4)
    assert_same(back, replay("pqo4", [cut(calls, 4), []]), rollback_suffix=False)


def test_int_caches_still_refuse_below_the_call_that_fixed_their_units():
    """The units of an int layer come from its first store with non-zero data (the prompt): the
    direct build of a shorter prompt may take other units and records its own call, which the
    layer cannot know, so nothing between the sinks-free start and that call is reachable."""
    rng = np.random.default_rng(14)
    cache, _ = _short_prompt("int2/small", rng, prompt=6, decodes=20)
    ok, low = _check_reach(cache, 0)
    assert low >= 6 and all(length == 0 or length >= low for length in ok)
    with pytest.raises(ValueError, match="calibrated it"):
        cache.truncate(0, 5)


def test_a_given_calibration_stays_and_reaches_the_sinks():
    """A given basis calibrates a layer from its first token (no calibrating call): cuts above
    reach as deep as the copies, and the sinks-only lengths keep the basis, as the direct build."""
    rng = np.random.default_rng(15)
    k, v, _ = tokens(rng, 2, 200)
    comp = arraykv.KVCacheCompressor(arraykv.LowRank(rank=4)).fit(k, v)
    calls = [("prefill", *tokens(rng, 1, 30))] + [("decode", *tokens(rng, 1, 1)) for _ in range(10)]
    cache = make("lowrank", calibration=comp, rollback_tokens=4)
    for call in calls:
        run(cache, 0, call)
    assert cache.layer_arrays(0)["fixed_end"][0] == 0
    ok, low = _check_reach(cache, 0)
    assert ok == [0, 1, 2, 3, 4] + list(range(36, 41)) and low == 36  # 16 encoded, the last 4 copied
    cache.truncate(0, 3)
    assert cache.is_fitted(0)
    direct = make("lowrank", calibration=comp, rollback_tokens=4)
    for call in cut(calls, 3):
        run(direct, 0, call)
    assert_same(cache, direct, rollback_suffix=False)
