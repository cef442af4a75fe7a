"""truncate, truncate_all, min_truncate_length and fork against a cache built directly.

"Built directly" is the same sequence of calls replayed with the truncated tokens left out (a
prefill or append cut in part becomes a shorter one, a cut decode disappears). A truncated or
forked cache must hold the same arrays, reconstruct the same K/V, promise the same stable
length, answer the next decode the same, count the same bytes and save a file that loads back
to the same state. The one documented difference: the rollback copies of the dropped encoded
tokens are gone, so a truncated layer holds a suffix of the direct build's copies (and
correspondingly fewer bytes, :meth:`rollback_bytes`) until new tokens are encoded.

Everything is compared bit for bit: every codec encodes a token from that token alone (and
its layer's calibration), so a shorter call encodes the surviving tokens to the same codes.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import arraykv

from cache_contract import attend

H, D, LAYERS = 2, 16, 2
ROLLBACK = ("k_rollback", "v_rollback")

#: Every registered method with its defaults, the generic families, and small windows, groups
#: and margins (label "method/variant") so that the short sequences drawn here cut through
#: encoded tokens, key groups and rollback copies often.
METHODS = {
    **{
        m: ("m", {})
        for m in ("dense", "pq2", "pq3", "pq4", "pqo2", "pqo3", "pqo4", "tq2", "tq3", "tq4", "int2", "int4", "int8")
    },
    "int": ("int", {"bits": 4, "group_size": 8, "residual_window": 16}),
    "polar": ("polar", {"key_bits": 3, "value_bits": 2, "residual_window": 6, "sink_tokens": 2, "rollback_tokens": 5}),
    "lowrank": ("lowrank", {"rank": 4}),
    "vq": ("vq", {"codebook_size": 4, "sub_dim": 4, "min_calibration": 16, "max_iter": 5}),
    "pqo4/small": ("pqo4", {"residual_window": 3, "sink_tokens": 1, "rollback_tokens": 6}),
    "tq2/small": ("tq2", {"residual_window": 2, "sink_tokens": 0, "rollback_tokens": 9}),
    "int2/small": ("int2", {"group_size": 4, "residual_window": 8, "rollback_tokens": 5}),
    "int8/small": ("int8", {"group_size": 4, "rollback_tokens": 7}),
    "lowrank/small": ("lowrank", {"rank": 4, "residual_window": 2, "sink_tokens": 1, "rollback_tokens": 6}),
    "vq/small": (
        "vq",
        {
            "codebook_size": 4,
            "sub_dim": 4,
            "min_calibration": 16,
            "max_iter": 5,
            "residual_window": 1,
            "sink_tokens": 2,
            "rollback_tokens": 4,
        },
    ),
}

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(label, **extra):
    method, options = METHODS[label]
    return arraykv.make_cache(
        label if method == "m" else method, num_layers=LAYERS, num_kv_heads=H, head_dim=D, **{**options, **extra}
    )


def tokens(rng, batch, t):
    k = rng.standard_normal((batch, H, t, D)).astype(np.float32)
    v = rng.standard_normal((batch, H, t, D)).astype(np.float32)
    q = rng.standard_normal((batch, H, t, D)).astype(np.float32)
    return k, v, q


CFG = arraykv.AttendConfig(D**-0.5, 1)


def run(cache, layer, call):
    kind, k, v, q = call
    if kind == "decode":
        return cache.decode(layer, k, v, q, CFG)
    return getattr(cache, kind)(layer, k, v, q)


def cut(history, length):
    """The calls that survive a truncation to ``length`` (a call cut in part becomes shorter)."""
    out, n = [], 0
    for kind, k, v, q in history:
        t = k.shape[2]
        if n + t <= length:
            out.append((kind, k, v, q))
        elif n < length and kind != "decode":
            keep = length - n
            out.append((kind, k[:, :, :keep], v[:, :, :keep], q[:, :, :keep]))
        n += t
    return out


def replay(method, histories, **extra):
    cache = make(method, **extra)
    for layer, history in enumerate(histories):
        for call in history:
            run(cache, layer, call)
    return cache


def assert_same(got, want, *, rollback_suffix=True):
    """``got`` (truncated/forked) holds what ``want`` (built directly) holds."""
    for i in range(LAYERS):
        assert got.seq_len(i) == want.seq_len(i)
        assert got.stable_length(i) == want.stable_length(i)
        a, b = got.layer_arrays(i), want.layer_arrays(i)
        assert sorted(a) == sorted(b), i
        for name in b:
            if name in ROLLBACK and rollback_suffix:  # a suffix: the copies of dropped tokens are gone
                m = a[name].shape[2]
                np.testing.assert_array_equal(a[name], b[name][:, :, b[name].shape[2] - m :], err_msg=name)
            else:
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        ra, rb = got.dequantize(i), want.dequantize(i)
        assert (ra is None) == (rb is None)
        if ra is not None:
            np.testing.assert_array_equal(ra.k, rb.k)
            np.testing.assert_array_equal(ra.v, rb.v)
    assert got.used_bytes() == want.used_bytes()  # rollback copies are not counted there
    assert got.memory_usage() >= got.used_bytes()
    for state in got._states:  # spare room stays within the buffers' growth bound after a truncation
        for buf in () if state is None else state.buffers():
            assert buf.capacity <= buf.growth * buf.length + buf.min_capacity


def assert_next_calls_same(got, want, rng, batch):
    """The next decode, and the next prefill (K/V and the QJL logit bias), answer the same."""
    k, v, q = tokens(rng, batch, 1)
    k3, v3, q3 = tokens(rng, batch, 3)
    for i in range(LAYERS):
        g, w = got.fork(), want.fork()
        # the stored arrays are equal (above); a fused kernel's answer over them may differ in the
        # last bits, as its vectorized or scalar loops are picked by where its buffers sit in memory
        a_g = attend(g.decode(i, k, v, q, CFG), q, CFG.softmax_scale)
        a_w = attend(w.decode(i, k, v, q, CFG), q, CFG.softmax_scale)
        np.testing.assert_allclose(a_g, a_w, rtol=1e-5, atol=1e-6 * float(np.abs(a_w).max()))
        rg, rw = got.fork().prefill(i, k3, v3, q3), want.fork().prefill(i, k3, v3, q3)
        np.testing.assert_array_equal(rg.k, rw.k)
        np.testing.assert_array_equal(rg.v, rw.v)
        assert (rg.logit_bias is None) == (rw.logit_bias is None)
        if rg.logit_bias is not None:
            np.testing.assert_array_equal(rg.logit_bias, rw.logit_bias)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["prefill", "append", "decode", "truncate", "truncate_all", "fork"]),
        st.integers(0, LAYERS - 1),
        st.integers(1, 24),
        st.floats(0.0, 1.0),
    ),
    min_size=3,
    max_size=14,
)


@pytest.mark.parametrize("method", sorted(METHODS))
@SETTINGS
@given(ops=OPS, prompt=st.integers(1, 40), batch=st.integers(1, 2), seed=st.integers(0, 2**31))
def test_random_interleavings_match_the_direct_build(method, ops, prompt, batch, seed, tmp_path_factory):
    rng = np.random.default_rng(seed)
    cache = make(method)
    histories = [[] for _ in range(LAYERS)]
    for layer in range(LAYERS):  # every layer starts with a prompt: the usual life of a cache
        call = ("prefill", *tokens(rng, batch, prompt))
        run(cache, layer, call)
        histories[layer].append(call)
    for op, layer, t, frac in ops:
        if op in ("prefill", "append", "decode"):
            call = (op, *tokens(rng, batch, 1 if op == "decode" else t))
            run(cache, layer, call)
            histories[layer].append(call)
            continue
        if op == "fork":
            twin = cache.fork()
            assert_same(twin, cache, rollback_suffix=False)
            k, v, q = tokens(rng, batch, 2)
            twin.append(layer, k, v, q)  # writes to the fork leave the original alone
            assert twin.seq_len(layer) == cache.seq_len(layer) + 2
            cache, twin = twin, cache
            histories[layer].append(("append", k, v, q))
            assert_same(
                twin, replay(method, [cut(h, twin.seq_len(i)) for i, h in enumerate(histories)]), rollback_suffix=True
            )
            continue
        layers = range(LAYERS) if op == "truncate_all" else [layer]
        n = max(cache.seq_len(i) for i in layers)
        lows = [cache.min_truncate_length(i) for i in layers]
        low = max(lows)
        length = 0 if frac < 0.05 else low + int(frac**2 * (n - low))  # mostly deep
        below = [m for m in range(1, low) if all(cache.can_truncate(i, min(m, cache.seq_len(i))) for i in layers)]
        if below and 0.05 <= frac < 0.35:  # under the floor: back before the calibrating call
            length = below[int((frac - 0.05) / 0.3 * len(below))]
        if low > 1 and frac > 0.95:  # one below the floor: refused, nothing changes
            before = [cache.layer_arrays(i) for i in range(LAYERS)]
            with pytest.raises(ValueError, match="rollback_tokens|calibrated"):
                if op == "truncate_all":
                    cache.truncate_all(low - 1)
                else:
                    cache.truncate(layer, low - 1)
            for i in range(LAYERS):
                after = cache.layer_arrays(i)
                assert sorted(after) == sorted(before[i])
                for name in after:
                    np.testing.assert_array_equal(after[name], before[i][name])
            continue
        if op == "truncate_all":
            cache.truncate_all(length)
        else:
            cache.truncate(layer, length)
        for i in layers:
            histories[i] = cut(histories[i], min(length, sum(c[1].shape[2] for c in histories[i])))
        direct = replay(method, histories)
        assert_same(cache, direct)
    direct = replay(method, histories)
    assert_same(cache, direct)
    assert_next_calls_same(cache, direct, rng, batch)
    path = tmp_path_factory.mktemp("files") / "c.akv"
    cache.save(path)
    back = arraykv.load(path)
    assert_same(back, cache, rollback_suffix=False)
    assert back.get_config() == cache.get_config()


# -- the margin: how deep a truncation reaches -----------------------------------------------------
@pytest.mark.parametrize("method", ["pqo4", "tq3", "lowrank", "int2", "int4", "int8"])
@pytest.mark.parametrize("rollback", [0, 5, 16, 40])
def test_rollback_tokens_deep_after_the_calibrating_call(method, rollback):
    """After the prompt, any truncation by up to ``rollback_tokens`` is exact (and one more is not,
    unless the window or the int residual happens to hold it)."""
    rng = np.random.default_rng(rollback)
    cache = make(method, rollback_tokens=rollback)
    assert cache.get_config()["rollback_tokens"] == rollback
    k, v, q = tokens(rng, 1, 40)
    cache.prefill(0, k, v, q)
    for step in range(70):
        kk, vv, qq = tokens(rng, 1, 1)
        cache.decode(0, kk, vv, qq, CFG)
        n = cache.seq_len(0)
        low = cache.min_truncate_length(0)
        assert low <= max(40, n - rollback), (step, low)
        if low > 1:
            with pytest.raises(ValueError, match=f"rollback_tokens={rollback}" if low > 40 else "calibrated"):
                cache.fork().truncate(0, low - 1)
    twin = cache.fork()
    twin.truncate(0, low)
    assert twin.seq_len(0) == low


@pytest.mark.parametrize("method", ["pqo3", "lowrank", "int4"])
def test_a_cut_inside_the_calibrating_call_is_refused(method):
    rng = np.random.default_rng(1)
    cache = make(method)
    k, v, q = tokens(rng, 1, 60)
    cache.prefill(0, k, v, q)
    assert cache.min_truncate_length(0) == 60
    with pytest.raises(ValueError, match="calibrated it") as err:
        cache.truncate(0, 59)
    assert "0 or" not in str(err.value) or "only 0" in str(err.value)
    cache.truncate(0, 0)  # always possible: the layer is empty
    assert cache.seq_len(0) == 0 and cache.dequantize(0) is None and cache.layer_arrays(0) == {}


def test_memory_of_the_default_margin_at_8k_tokens():
    """pqo4 at 8192 tokens, head_dim 64: the default copies cost well under 1 % of the cache."""
    rng = np.random.default_rng(0)
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=64)
    k = rng.standard_normal((1, 2, 8192, 64)).astype(np.float32)
    cache.prefill(0, k, k, k)
    assert cache.rollback_bytes() == 2 * 2 * 16 * 64 * 2 + 8
    assert cache.rollback_bytes() / cache.memory_usage() < 0.01


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["dense", "pqo4", "int2", "lowrank"])
def test_bad_layers_and_lengths_are_refused_before_anything_changes(method):
    rng = np.random.default_rng(2)
    cache = make(method)
    k, v, q = tokens(rng, 1, 30)
    cache.prefill(0, k, v, q)
    before = cache.layer_arrays(0)
    for layer, length, exc in (
        (2, 1, ValueError),
        (-1, 1, ValueError),
        ("0", 1, TypeError),
        (0.0, 1, TypeError),
        (0, 31, ValueError),
        (0, -1, ValueError),
        (0, 3.0, TypeError),
        (0, "3", TypeError),
        (0, True, TypeError),
        (1, 1, ValueError),
    ):
        with pytest.raises(exc, match="layer|length"):
            cache.truncate(layer, length)
    for length, exc in ((31, ValueError), (-1, ValueError), (2.5, TypeError), (None, TypeError)):
        with pytest.raises(exc, match="length"):
            cache.truncate_all(length)
    with pytest.raises(TypeError, match="layer"):
        cache.min_truncate_length("0")
    after = cache.layer_arrays(0)
    assert sorted(after) == sorted(before)
    for name in after:
        np.testing.assert_array_equal(after[name], before[name])
    cache.truncate(1, 0)  # an empty layer: 0 is its length, nothing to do
    assert cache.min_truncate_length(1) == 0


def test_truncate_all_is_all_or_none():
    rng = np.random.default_rng(3)
    cache = make("pqo4")
    k, v, q = tokens(rng, 1, 40)
    cache.prefill(0, k, v, q)  # layer 0 calibrated on 40 tokens
    cache.prefill(1, k[:, :, :10], v[:, :, :10], q[:, :, :10])
    for t in range(30):
        cache.append(1, k[:, :, 10 + t : 11 + t], v[:, :, 10 + t : 11 + t], q[:, :, 10 + t : 11 + t])
    before = [cache.layer_arrays(i) for i in range(LAYERS)]
    with pytest.raises(ValueError, match="layer 0"):
        cache.truncate_all(35)  # layer 1 could; layer 0 cannot: neither changes
    for i in range(LAYERS):
        assert all(np.array_equal(cache.layer_arrays(i)[n], before[i][n]) for n in before[i])
    cache.truncate(1, 30)
    with pytest.raises(ValueError, match="longest"):
        cache.truncate_all(41)
    cache.truncate_all(40)  # layer 0 holds 40 (nothing to do), layer 1 fewer: left alone
    assert cache.seq_len(0) == 40 and cache.seq_len(1) == 30
    cache.truncate_all(0)
    assert cache.seq_len(0) == cache.seq_len(1) == 0 and cache.memory_usage() == 0


def test_concurrent_truncates_on_different_layers():
    rng = np.random.default_rng(4)
    layers = 8
    cache = arraykv.make_cache("pqo3", num_layers=layers, num_kv_heads=H, head_dim=D)
    calls = []
    for i in range(layers):
        k, v, q = tokens(rng, 1, 30)
        cache.prefill(i, k, v, q)
        extra = [tokens(rng, 1, 1) for _ in range(20)]
        for kk, vv, qq in extra:
            cache.decode(i, kk, vv, qq, CFG)
        calls.append((k, v, q, extra))
    errors = []

    def work(i):
        try:
            for length in range(49, 35, -1):
                cache.truncate(i, length)
                cache.seq_len(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(layers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, (k, v, q, extra) in enumerate(calls):
        direct = arraykv.make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D)
        direct.prefill(0, k, v, q)
        for kk, vv, qq in extra[:6]:
            direct.decode(0, kk, vv, qq, CFG)
        np.testing.assert_array_equal(cache.dequantize(i).k, direct.dequantize(0).k)


def test_fork_is_independent_and_keeps_the_given_calibration():
    rng = np.random.default_rng(5)
    cache = make("pqo4")
    k, v, q = tokens(rng, 1, 30)
    cache.prefill(0, k, v, q)
    twin = cache.fork()
    assert twin.get_config() == cache.get_config() and twin is not cache
    kk, vv, qq = tokens(rng, 1, 1)
    twin.decode(0, kk, vv, qq, CFG)
    assert cache.seq_len(0) == 30 and twin.seq_len(0) == 31
    cache.reset()
    assert twin.seq_len(0) == 31 and twin.dequantize(0) is not None
    assert twin.rollback_tokens == cache.rollback_tokens == 16


def test_files_from_before_rollback_copies_still_load():
    """A snapshot without rollback arrays (as older files hold) loads; the layer then refuses any
    cut it cannot prove exact and grows its copies again as it encodes."""
    rng = np.random.default_rng(6)
    for method in ("pqo4", "int2", "lowrank"):
        cache = make(method)
        k, v, q = tokens(rng, 1, 50)
        cache.prefill(0, k, v, q)
        records = cache.snapshot()
        old = [
            None
            if r is None
            else type(r)(
                length=r.length,
                batch=r.batch,
                dtype=r.dtype,
                arrays={n: a for n, a in r.arrays.items() if n not in ROLLBACK + ("fixed_end",)},
            )
            for r in records
        ]
        back = make(method)
        back.restore(old)
        np.testing.assert_array_equal(back.dequantize(0).k, cache.dequantize(0).k)
        assert back.min_truncate_length(0) == 50
        back.truncate(0, 0)


@pytest.mark.parametrize("method", ["dense", "pqo4/small", "int2/small", "int4", "lowrank/small"])
def test_truncate_and_fork_in_every_namespace(xp, method):
    """The same on array_api_strict (float32 windows) and CuPy where present: truncate, then
    equal to the direct build; a fork is equal and independent."""
    from conftest import asarray, to_np

    rng = np.random.default_rng(7)
    calls = [tokens(rng, 1, 20)] + [tokens(rng, 1, 1) for _ in range(12)]
    calls = [tuple(asarray(xp, a) for a in c) for c in calls]
    cache = make(method)
    cache.prefill(0, *calls[0])
    for c in calls[1:]:
        cache.decode(0, *c, CFG)
    length = max(cache.min_truncate_length(0), 25)
    twin = cache.fork()
    cache.truncate(0, length)
    direct = make(method)
    direct.prefill(0, *calls[0])
    for c in calls[1 : length - 19]:
        direct.decode(0, *c, CFG)
    a, b = cache.layer_arrays(0), direct.layer_arrays(0)
    assert sorted(a) == sorted(b)
    for name in b:
        if name not in ROLLBACK:
            np.testing.assert_array_equal(to_np(a[name]), to_np(b[name]), err_msg=name)
    np.testing.assert_array_equal(to_np(cache.dequantize(0).k), to_np(direct.dequantize(0).k))
    assert twin.seq_len(0) == 32 and cache.seq_len(0) == length
