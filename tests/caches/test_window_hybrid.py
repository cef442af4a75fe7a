"""SlidingWindowCache ("window") and HybridCache ("hybrid") against a slow, obviously correct reference.

The reference (:class:`Ref`) keeps every key and value ever given in one NumPy array per layer
(rounded to float16 for the default storage, as given for ``storage="exact"``) and the position
of the oldest row the cache should still hold; what the cache returns is then a slice by
position: ``prefill`` the rows held before the call plus the new ones, ``decode`` the last
``window`` positions. Everything is compared bit for bit (float16 -> float32 is exact).

A truncated layer must answer later calls as a layer built directly from that many tokens does
(for attention: the last ``window`` rows of a decode, the rows a causal chunk can see in a
prefill); a rejected call (truncate, restore, overflow) must leave the cache exactly as it was.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv import ops
from arraykv.caches.hybrid import HybridCache
from arraykv.caches.polar_calibration import calibrate
from arraykv.caches.polar_codec import PolarFixed
from arraykv.caches.polar_decode import decode_tokens
from arraykv.caches.polar_options import check_polar_options
from arraykv.caches.window_cache import POLAR_STORAGE, SlidingWindowCache
from arraykv.quant.polar_encoder import PolarEncoder
from arraykv.storage.cache_file import LayerRecord

from cache_contract import assert_same_snapshot, snapshot
from conftest import to_np

H, D = 2, 8


# -- the reference ------------------------------------------------------------------------
class Ref:
    """One window layer, kept whole: all K/V in plain arrays, the held rows sliced by position.

    Float storages keep every row as stored (float16-rounded or as given). The ``pq`` storages
    keep every row decoded from its codes (the layer's calibration is made by the first call,
    each row encoded by itself) and float16 copies of every row: the last ``exact_tail``
    positions read the copies. Every call is recorded, so a truncated reference can be replayed.
    """

    def __init__(self, window: int, rollback: int, storage: str = "float16", exact_tail: int = 8):
        self.window, self.keep, self.storage = window, window + rollback, storage
        self.exact_tail = exact_tail if storage in POLAR_STORAGE else 0
        self.kd = self.vd = self.k16 = self.v16 = None
        self.calib = None
        self.calls = []  # (k, v, q) of every call
        self.first = 0  # position of the oldest row the cache holds

    @property
    def length(self) -> int:
        return 0 if self.kd is None else int(self.kd.shape[2])

    @property
    def held(self) -> int:
        return self.length - self.first

    def _view(self, a, a16):
        if not self.exact_tail or a is None:
            return a
        out = a.copy()
        r = min(self.exact_tail, self.length)
        out[:, :, self.length - r :] = a16[:, :, self.length - r :]
        return out

    @property
    def k(self):
        """Every position's key as the layer reads it now."""
        return self._view(self.kd, self.k16)

    @property
    def v(self):
        return self._view(self.vd, self.v16)

    def _stored(self, k, v, q):
        if self.storage == "exact":
            return k, v
        if self.storage not in POLAR_STORAGE:
            return k.astype(np.float16).astype(k.dtype), v.astype(np.float16).astype(v.dtype)
        bits = POLAR_STORAGE[self.storage]
        opts = check_polar_options(D, key_bits=bits, value_bits=bits)
        fixed = PolarFixed.build(np, None, head_dim=D, key_bits=bits, value_bits=bits, seed=0, qjl=False)
        k32, v32 = k.astype(np.float32), v.astype(np.float32)
        if self.calib is None:
            self.calib = calibrate(opts, np, k32, v32, q.astype(np.float32), self.length)
        c = self.calib
        enc = PolarEncoder(
            c.k_mean,
            c.v_mean,
            c.k_scale,
            c.k_outlier_idx,
            c.k_mean_freq,
            c.k_mean_pairs,
            fixed.k_codebook,
            fixed.v_codebook,
            fixed.rotation,
            True,
            True,
        )
        codes = ops.polar_encode_tokens(k32, v32, enc, self.length)
        kd, vd = decode_tokens(codes, c, fixed, bits, bits, self.length)
        return np.asarray(kd).astype(k.dtype), np.asarray(vd).astype(v.dtype)

    def _push(self, k, v, q):
        self.calls.append((k, v, q))
        kd, vd = self._stored(k, v, q)
        k16, v16 = k.astype(np.float16).astype(k.dtype), v.astype(np.float16).astype(v.dtype)
        if self.kd is None:
            self.kd, self.vd, self.k16, self.v16 = kd.copy(), vd.copy(), k16, v16
        else:
            self.kd, self.vd = np.concatenate([self.kd, kd], axis=2), np.concatenate([self.vd, vd], axis=2)
            self.k16, self.v16 = np.concatenate([self.k16, k16], axis=2), np.concatenate([self.v16, v16], axis=2)
        self.first = max(self.first, self.length - self.keep)

    def prefill(self, k, v, q=None):
        """The rows held before the call, as read then, and the new ones (as given for pq)."""
        held_k = None if self.kd is None else self.k[:, :, self.first :]
        held_v = None if self.kd is None else self.v[:, :, self.first :]
        self._push(k, v, q)
        t = int(k.shape[2])
        nk, nv = (k, v) if self.storage in POLAR_STORAGE else (self.kd[:, :, -t:], self.vd[:, :, -t:])
        if held_k is None:
            return nk, nv
        return np.concatenate([held_k, nk], axis=2), np.concatenate([held_v, nv], axis=2)

    def decode(self, k, v, q=None):
        self._push(k, v, q)
        s = max(0, self.length - self.window)
        return self.k[:, :, s:], self.v[:, :, s:]

    @property
    def first_call_end(self) -> int:
        return int(self.calls[0][0].shape[2]) if self.calls else 0

    def reachable(self, length: int) -> bool:
        """Exact truncation needs what the next decode reads (positions ``length - window + 1 ..``)
        still held, and, once rows were dropped, at least one row left; for the pq storages a
        length past the first call (its calibration) and within the float16 copies' reach."""
        if length in (0, self.length):
            return True
        if not 0 < length < self.length:
            return False
        if self.storage in POLAR_STORAGE:
            if length < self.first_call_end:
                return False
            copies = min(self.held, self.exact_tail + self.keep - self.window)  # float16 tail rows held
            if copies < self.held and length < self.length - (copies - self.exact_tail):
                return False
        return self.first == 0 or length >= self.first + max(self.window - 1, 1)

    def truncated(self, length: int) -> Ref:
        """A reference of the first ``length`` positions (the calls replayed, the last one cut)."""
        out = Ref(self.window, self.keep - self.window, self.storage, self.exact_tail or 8)
        left = length
        for k, v, q in self.calls:
            if left <= 0:
                break
            t = min(left, int(k.shape[2]))
            out._push(k[:, :, :t], v[:, :, :t], None if q is None else q[:, :, :t])
            left -= t
        out.first = min(self.first, length)
        return out

    def replay(self, cache, layer=0):
        """Feed this reference's calls to ``cache``."""
        for k, v, q in self.calls:
            cache.prefill(layer, k, v, q)


def kvq(rng, batch, t, groups=1, dtype=np.float32, scale=1.0):
    k = (scale * rng.standard_normal((batch, H, t, D))).astype(dtype)
    v = (scale * rng.standard_normal((batch, H, t, D))).astype(dtype)
    q = rng.standard_normal((batch, H * groups, t, D)).astype(dtype)
    return k, v, q


def config(groups):
    return arraykv.AttendConfig(softmax_scale=D**-0.5, n_kv_groups=groups)


def window_cache(window, rollback, storage="float16", layers=1, decode_path="dequantized"):
    """A window cache; its decode returns K/V (the fused decode is checked on its own)."""
    return arraykv.make_cache(
        "window",
        num_layers=layers,
        num_kv_heads=H,
        head_dim=D,
        window=window,
        rollback_tokens=rollback,
        storage=storage,
        decode_path=decode_path,
    )


def random_ops(rng, keep, n):
    """``n`` calls: ("prefill", t) with chunks below, at and above ``keep`` rows, or ("decode", 1)."""
    ops = []
    for _ in range(n):
        if rng.random() < 0.4:
            ops.append(("prefill", int(rng.integers(1, 2 * keep + 3))))
        else:
            ops.append(("decode", 1))
    return ops


def run_op(cache, layer, op, k, v, q, groups):
    """One call; the K/V it returns as NumPy arrays (None for a fused decode of a compressed full layer)."""
    if op == "prefill":
        r = cache.prefill(layer, k, v, q)
    else:
        out = cache.decode(layer, k, v, q, config(groups))
        if isinstance(out, arraykv.Fused):
            assert isinstance(cache, HybridCache) and not cache.is_sliding(layer)
            return None
        assert isinstance(out, arraykv.Dequantized)
        r = out.result
    assert r.logit_bias is None
    assert r.k.dtype == k.dtype and r.v.dtype == v.dtype
    return to_np(r.k), to_np(r.v)


def check_same(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


# -- 1. the window cache against the reference -----------------------------------------------
#: (window, rollback_tokens, batch, q heads per kv head, storage, dtype)
CASES = [
    (1, 0, 1, 1, "float16", np.float32),
    (1, 3, 2, 2, "exact", np.float32),
    (3, 0, 1, 2, "float16", np.float32),
    (4, 2, 2, 1, "exact", np.float32),
    (5, 16, 1, 3, "float16", np.float32),
    (2, 5, 2, 2, "float16", np.float32),
    (3, 1, 1, 2, "exact", np.float64),
    (1, 2, 1, 1, "pq4", np.float32),
    (4, 3, 2, 2, "pq3", np.float32),
    (5, 16, 1, 3, "pq2", np.float32),
    (3, 1, 1, 2, "pq4", np.float64),
    (4, 2, 1, 2, "pq5", np.float32),
    (3, 0, 2, 1, "pq8", np.float32),
]


@pytest.mark.parametrize("window, rollback, batch, groups, storage, dtype", CASES)
def test_window_matches_reference(rng, window, rollback, batch, groups, storage, dtype):
    cache = window_cache(window, rollback, storage, layers=2)
    refs = [Ref(window, rollback, storage) for _ in range(2)]
    keep = window + rollback
    for op, t in random_ops(rng, keep, 60):
        layer = int(rng.integers(0, 2))
        k, v, q = kvq(rng, batch, t, groups, dtype)
        want = refs[layer].prefill(k, v, q) if op == "prefill" else refs[layer].decode(k, v, q)
        got = run_op(cache, layer, op, k, v, q, groups)
        check_same(got, want)
        if op == "decode":
            assert got[0].shape[2] == min(window, refs[layer].length)
        for i, ref in enumerate(refs):
            assert cache.seq_len(i) == ref.length
            assert cache.held_tokens(i) == ref.held == min(ref.length, keep)
            d = cache.dequantize(i)
            if ref.length:
                check_same((to_np(d.k), to_np(d.v)), (ref.k[:, :, ref.first :], ref.v[:, :, ref.first :]))
            else:
                assert d is None
    # reading from a held position gives the tail; an older one is refused
    ref = refs[0]
    if ref.length:
        tail = cache.dequantize(0, ref.length - 1)
        check_same((to_np(tail.k),), (ref.k[:, :, ref.length - 1 :],))
        if ref.first:
            with pytest.raises(ValueError, match="start"):
                cache.dequantize(0, ref.first - 1)


#: Bytes of one held row of keys (or values) per storage, float32 input: float16, as given,
#: packed codes plus a float16 length.
ROW_BYTES = {
    "float16": 2 * D,
    "exact": 4 * D,
    "pq5": 5 * D // 8 + 2,
    "pq4": D // 2 + 2,
    "pq3": 3 * D // 8 + 2,
    "pq2": D // 4 + 2,
}


@pytest.mark.parametrize("storage, row_bytes", [(s, ROW_BYTES[s]) for s in ("float16", "exact", "pq4", "pq3")])
def test_memory_bounded_by_window(rng, storage, row_bytes):
    window, rollback, batch = 4, 3, 2
    keep = window + rollback
    cache = window_cache(window, rollback, storage)
    assert cache.memory_usage() == 0 and cache.used_bytes() == 0
    row = 2 * batch * H * row_bytes  # one position of k and v (codes and float16 length for pq)
    bound = (keep + max(16, keep // 4)) * row  # the rows kept and a quarter (at least 16) of spare room
    k, v, q = kvq(rng, batch, 2)
    cache.prefill(0, k, v, q)
    fixed = cache._fixed_nbytes()  # the pq rotation's signs and codebooks; 0 for float storage
    assert (fixed > 0) == storage.startswith("pq")
    st = cache._states[0]
    calib = 0 if st.calib is None else st.calib.nbytes()  # pq: the layer's means, weights, channels

    def extra(n):
        """pq: the float16 rows of the exact tail (used), and of the rollback margin with the
        8-byte record of the calibrating call (memory only)."""
        if not storage.startswith("pq"):
            return 0, 0
        tail = min(n, cache.tail_keep, keep)
        exact = min(tail, cache.exact_tail)
        return calib + exact * 2 * batch * H * D * 2, calib + tail * 2 * batch * H * D * 2 + 8

    seen = 2
    used = [cache.used_bytes() - fixed - extra(seen)[0]]
    mem = [cache.memory_usage() - fixed - extra(seen)[1]]
    for _ in range(60):
        k, v, q = kvq(rng, batch, 1)
        cache.decode(0, k, v, q, config(1))
        seen += 1
        used.append(cache.used_bytes() - fixed - extra(seen)[0])
        mem.append(cache.memory_usage() - fixed - extra(seen)[1])
        assert used[-1] == row * cache.held_tokens(0)
        assert cache.memory_usage() - cache.used_bytes() >= cache.rollback_bytes()
    assert used[0] == 2 * row and max(used) == keep * row
    assert used == sorted(used) and used[-1] == keep * row  # grows, then stays at the kept rows
    assert 0 < max(mem) <= bound and mem[-1] == mem[keep + cache.tail_keep]
    k, v, q = kvq(rng, batch, 200)  # a chunk far longer than the window
    cache.prefill(0, k, v, q)
    seen += 200
    assert cache.seq_len(0) == 262 and cache.held_tokens(0) == keep
    assert cache.used_bytes() - fixed - extra(seen)[0] == keep * row
    assert cache.memory_usage() - fixed - extra(seen)[1] <= bound


def test_window_options_refused():
    with pytest.raises(ValueError, match="window"):
        window_cache(0, 1)
    with pytest.raises(ValueError, match="storage"):
        window_cache(3, 1, storage="int8")
    with pytest.raises(ValueError, match="rollback_tokens"):
        window_cache(3, -1)


def test_window_outlier_options_reach_the_codec_and_survive_save_load(rng, tmp_path):
    """``outliers`` / ``max_outliers`` set the pq storage's exact key channels, as for pqo."""
    d, t = 32, 64
    k = rng.standard_normal((1, H, t, d)).astype(np.float32)
    k[..., [3, 17]] *= 40.0  # two key channels far above the others, in every head
    v = rng.standard_normal((1, H, t, d)).astype(np.float32)
    q = rng.standard_normal((1, H, t, d)).astype(np.float32)
    counts = {}
    for name, opts in (
        ("auto", {}),
        ("capped", {"max_outliers": 1}),
        ("none", {"outliers": 0}),
        ("fixed", {"outliers": 3}),
    ):
        c = arraykv.make_cache("window", num_layers=1, num_kv_heads=H, head_dim=d, window=t, storage="pq4", **opts)
        c.prefill(0, k, v, q)
        counts[name] = c._states[0].calib.n_outliers
        path = tmp_path / f"{name}.akv"
        c.save(path)
        back = arraykv.load(path)
        assert back.options == c.options
        np.testing.assert_array_equal(to_np(back.dequantize(0).k), to_np(c.dequantize(0).k))
    assert counts == {"auto": 2, "capped": 1, "none": 0, "fixed": 3}
    with pytest.raises(ValueError, match="max_outliers applies to the pq storages"):
        window_cache(3, 1, storage="float16").__class__(
            num_layers=1, num_kv_heads=H, head_dim=D, window=3, max_outliers=2
        )
    with pytest.raises(ValueError, match="outliers"):
        arraykv.make_cache("window", num_layers=1, num_kv_heads=H, head_dim=D, window=3, storage="exact", outliers=1)


# -- 2. truncate ------------------------------------------------------------------------------
TRUNC_CASES = [
    (1, 0, "float16"),
    (1, 2, "exact"),
    (2, 0, "float16"),
    (3, 2, "exact"),
    (4, 3, "float16"),
    (5, 0, "exact"),
    (3, 2, "pq4"),
    (2, 1, "pq2"),
]


def build(rng, window, rollback, storage, ops, batch=1, groups=2):
    cache, ref = window_cache(window, rollback, storage), Ref(window, rollback, storage)
    for op, t in ops:
        k, v, q = kvq(rng, batch, t, groups)
        (ref.prefill if op == "prefill" else ref.decode)(k, v, q)
        run_op(cache, 0, op, k, v, q, groups)
    return cache, ref


def direct(window, rollback, storage, ref, length):
    """A cache built from the first ``length`` positions: in one prefill (float storages: any
    calls give the same state), or by the reference's calls (pq: the first call calibrates)."""
    cache = window_cache(window, rollback, storage)
    if storage in POLAR_STORAGE:
        ref.replay(cache)
    elif length:
        cache.prefill(0, ref.k[:, :, :length], ref.v[:, :, :length], np.zeros((1, 2 * H, length, D), np.float32))
    return cache


@pytest.mark.parametrize("window, rollback, storage", TRUNC_CASES)
def test_truncate_every_length(rng, tmp_path, window, rollback, storage):
    keep = window + rollback
    ops = [("prefill", 3)] + [("decode", 1)] * (keep + 3) + [("prefill", 2)]
    cache, ref = build(rng, window, rollback, storage, ops)
    n = ref.length
    later = [("decode", 1), ("prefill", 3), *[("decode", 1)] * (keep + 1), ("prefill", keep + 2), ("decode", 1)]
    reach = [cache.can_truncate(0, L) for L in range(n + 1)]
    assert reach == [ref.reachable(L) for L in range(n + 1)]
    assert not cache.can_truncate(0, n + 1)
    floor = cache.min_truncate_length(0)
    assert floor == min(L for L in range(1, n + 1) if all(reach[L:]))  # every length from it up
    for length in range(n + 2):
        twin = cache.fork()
        before = snapshot(twin)
        if length > n or not reach[length]:
            with pytest.raises(ValueError):
                twin.truncate(0, length)
            assert_same_snapshot(snapshot(twin), before)
            assert twin.held_tokens(0) == ref.held and twin.min_truncate_length(0) == floor
            continue
        twin.truncate(0, length)
        tref = ref.truncated(length)
        assert twin.seq_len(0) == length and twin.held_tokens(0) == tref.held
        # the truncated state can be snapshotted, restored, saved and loaded
        other = window_cache(window, rollback, storage)
        other.restore(twin.snapshot())
        assert_same_snapshot(snapshot(other), snapshot(twin))
        twin.save(tmp_path / "t.akv")
        assert_same_snapshot(snapshot(arraykv.load(tmp_path / "t.akv")), snapshot(twin))
        # later calls answer as a direct build of `length` tokens does
        base = direct(window, rollback, storage, tref, length)
        for op, t in later:
            k, v, q = kvq(rng, 1, t, 2)
            start = tref.length
            want = tref.prefill(k, v, q) if op == "prefill" else tref.decode(k, v, q)
            got = run_op(twin, 0, op, k, v, q, 2)
            got_direct = run_op(base, 0, op, k, v, q, 2)
            if op == "decode":
                check_same(got, want)
                check_same(got, got_direct)
            else:  # the rows a causal chunk at positions start .. start + t - 1 can see
                m = min(window - 1 + t, start + t)
                assert got[0].shape[2] >= m
                check_same([a[:, :, -m:] for a in got], [a[:, :, -m:] for a in got_direct])
                check_same(got, want)
        assert twin.seq_len(0) == base.seq_len(0) == tref.length
        assert_same_snapshot(snapshot(twin), snapshot(base))  # keep rows stored since: the same state


@pytest.mark.parametrize("window, rollback, storage", TRUNC_CASES[:4])
def test_truncate_after_random_calls(rng, window, rollback, storage):
    keep = window + rollback
    for _ in range(4):
        cache, ref = build(rng, window, rollback, storage, random_ops(rng, keep, int(rng.integers(1, 12))))
        for length in range(ref.length + 1):
            assert cache.can_truncate(0, length) == ref.reachable(length), length
        twin = cache.fork()
        length = int(rng.integers(0, ref.length + 1))
        if ref.reachable(length):
            twin.truncate_all(length)
            assert twin.seq_len(0) == length
        else:
            before = snapshot(twin)
            with pytest.raises(ValueError):
                twin.truncate_all(length)
            assert_same_snapshot(snapshot(twin), before)


def test_truncate_refusals_name_the_problem(rng):
    cache, ref = build(rng, 3, 2, "float16", [("prefill", 10)])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="rollback_tokens=2"):
        cache.truncate(0, 5)
    with pytest.raises(ValueError, match="length"):
        cache.truncate(0, 11)
    with pytest.raises(TypeError):
        cache.truncate(0, 7.0)
    with pytest.raises(ValueError):
        cache.truncate(0, -1)
    assert_same_snapshot(snapshot(cache), before)
    assert cache.min_truncate_length(0) == 7 and cache.can_truncate(0, 7) and not cache.can_truncate(0, 6)
    cache.truncate(0, 0)
    assert cache.seq_len(0) == 0 and cache.held_tokens(0) == 0 and cache.memory_usage() == 0


# -- 3. fork, snapshot/restore, save/load ------------------------------------------------------
def test_fork_is_independent(rng):
    cache, ref = build(rng, 3, 2, "float16", [("prefill", 4), *[("decode", 1)] * 5])
    twin = cache.fork()
    assert_same_snapshot(snapshot(twin), snapshot(cache))
    before = snapshot(cache)
    for _ in range(8):  # enough to move every row of the twin's buffers
        k, v, q = kvq(rng, 1, 1, 2)
        twin.decode(0, k, v, q, config(2))
    twin.truncate(0, twin.min_truncate_length(0))
    assert_same_snapshot(snapshot(cache), before)
    after_twin = snapshot(twin)
    for op, t in [("prefill", 3)] + [("decode", 1)] * 8:
        k, v, q = kvq(rng, 1, t, 2)
        want = ref.prefill(k, v, q) if op == "prefill" else ref.decode(k, v, q)
        check_same(run_op(cache, 0, op, k, v, q, 2), want)
    assert_same_snapshot(snapshot(twin), after_twin)
    assert twin.get_config() == cache.get_config()


@pytest.mark.parametrize("storage", ["float16", "exact"])
def test_snapshot_restore_save_load(rng, tmp_path, storage):
    cache = window_cache(4, 2, storage, layers=3)
    refs = [Ref(4, 2, storage) for _ in range(3)]
    for layer, t in [(0, 9), (1, 2)]:  # layer 2 stays empty
        k, v, q = kvq(rng, 2, t)
        refs[layer].prefill(k, v, q)
        cache.prefill(layer, k, v, q)
    state, recs = snapshot(cache), cache.snapshot()
    assert recs[2] is None and recs[0].length == 9 and recs[0].arrays["k"].shape[2] == 6
    assert recs[0].arrays["k"].dtype == (np.float16 if storage == "float16" else np.float32)
    size = cache.save(tmp_path / "c.akv")
    assert size == (tmp_path / "c.akv").stat().st_size
    loaded = arraykv.load(tmp_path / "c.akv")
    assert isinstance(loaded, SlidingWindowCache) and loaded.get_config() == cache.get_config()
    assert_same_snapshot(snapshot(loaded), state)
    for _ in range(5):
        k, v, q = kvq(rng, 2, 1)
        cache.decode(0, k, v, q, config(1))
    cache.restore(recs)
    assert_same_snapshot(snapshot(cache), state)
    assert cache.held_tokens(0) == 6 and cache.min_truncate_length(0) == loaded.min_truncate_length(0)
    for op, t in [("decode", 1), ("prefill", 3), *[("decode", 1)] * 7]:  # all three answer alike
        k, v, q = kvq(rng, 2, t)
        want = refs[0].prefill(k, v, q) if op == "prefill" else refs[0].decode(k, v, q)
        check_same(run_op(cache, 0, op, k, v, q, 1), want)
        check_same(run_op(loaded, 0, op, k, v, q, 1), want)
    assert_same_snapshot(snapshot(loaded), snapshot(cache))


def _bad_records(rec, storage):
    """Records of a (batch 1, 9 tokens, window 4, rollback 2: 6 rows) layer that describe no state."""
    k, v = rec.arrays["k"], rec.arrays["v"]
    other = np.float32 if storage == "float16" else np.float16

    def r(length=rec.length, batch=rec.batch, dtype=rec.dtype, **arrays):
        return LayerRecord(length=length, batch=batch, dtype=dtype, arrays={"k": k, "v": v, **arrays})

    extra = lambda a: np.concatenate([a, a[:, :, :1]], axis=2)  # noqa: E731
    return {
        "head_dim": r(k=k[..., :-1], v=v[..., :-1]),
        "kv_heads": r(k=k[:, :1], v=v[:, :1]),
        "batch": r(batch=2),
        "3-d": r(k=k[0], v=v[0]),
        "k and v differ": r(v=v[:, :, 1:]),
        "too many rows": r(k=extra(k), v=extra(v)),
        "more rows than tokens": r(length=5),
        "too few rows": r(k=k[:, :, -2:], v=v[:, :, -2:]),
        "no rows": r(k=k[:, :, :0], v=v[:, :, :0]),
        "array dtype": r(k=k.astype(other), v=v.astype(other)),
        **({"record dtype": r(dtype="float64")} if storage == "exact" else {}),  # float16 rows serve any dtype
        "unknown dtype": r(dtype="int32"),
        "missing v": LayerRecord(length=rec.length, batch=rec.batch, dtype=rec.dtype, arrays={"k": k}),
    }


BAD = [
    "head_dim",
    "kv_heads",
    "batch",
    "3-d",
    "k and v differ",
    "too many rows",
    "more rows than tokens",
    "too few rows",
    "no rows",
    "array dtype",
    "record dtype",
    "unknown dtype",
    "missing v",
    "too few layers",
    "too many layers",
]


@pytest.mark.parametrize(
    "storage, what", [(s, w) for s in ("float16", "exact") for w in BAD if (s, w) != ("float16", "record dtype")]
)  # float16 rows serve any dtype
def test_restore_refuses_bad_records(rng, storage, what):
    cache = window_cache(4, 2, storage, layers=2)
    for layer, t in [(0, 9), (1, 9)]:
        k, v, q = kvq(rng, 1, t)
        cache.prefill(layer, k, v, q)
    recs = cache.snapshot()
    fresh = window_cache(4, 2, storage, layers=2)
    fresh.restore(recs)  # the good records restore
    assert_same_snapshot(snapshot(fresh), snapshot(cache))
    k, v, q = kvq(rng, 1, 1)
    cache.decode(0, k, v, q, config(1))  # differ from the records
    before = snapshot(cache)
    layers = {"too few layers": recs[:1], "too many layers": recs + [None]}.get(what)
    if layers is None:
        layers = [recs[0], _bad_records(recs[1], storage)[what]]
    with pytest.raises(ValueError):
        cache.restore(layers)
    assert_same_snapshot(snapshot(cache), before)


# -- 4. float16 overflow ----------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_overflow_refused_exact_accepts(rng):
    cache = window_cache(3, 1, layers=2)
    k, v, q = kvq(rng, 1, 4)
    cache.prefill(0, k, v, q)
    before = snapshot(cache)
    big = k.copy()
    big[0, 1, 2, 3] = 70000.0
    with pytest.raises(ValueError, match="65504"):
        cache.prefill(0, big, v, q)
    with pytest.raises(ValueError, match="65504"):
        cache.prefill(1, v, big, q)  # an empty layer stays empty
    with pytest.raises(ValueError, match="65504"):
        cache.decode(0, big[:, :, 2:3], v[:, :, :1], q[:, :, :1], config(1))
    assert_same_snapshot(snapshot(cache), before)
    assert cache.seq_len(1) == 0 and cache.held_tokens(0) == 4
    ok = k.copy()
    ok[0, 0, 0, 0] = 65504.0  # the largest float16 is stored
    got = cache.prefill(1, ok, v, q)
    assert to_np(got.k)[0, 0, 0, 0] == 65504.0
    exact = window_cache(3, 1, "exact")
    got = exact.prefill(0, big, v, q)
    np.testing.assert_array_equal(to_np(got.k), big)
    out = exact.decode(0, big[:, :, 2:3], v[:, :, :1], q[:, :, :1], config(1))
    assert to_np(out.result.k)[0, 1, -1, 3] == 70000.0


# -- 5. the hybrid cache ----------------------------------------------------------------------
TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
WINDOW, W_ROLLBACK = 3, 2


def hybrid(full_method="dense", layer_types=TYPES, **options):
    options.setdefault("window_options", {"rollback_tokens": W_ROLLBACK, "decode_path": "dequantized"})
    return arraykv.make_cache(
        "hybrid",
        num_layers=len(layer_types),
        num_kv_heads=H,
        head_dim=D,
        layer_types=list(layer_types),
        window=WINDOW,
        full_method=full_method,
        **options,
    )


def feed(rng, cache, ops, refs=None, groups=2):
    """The same calls on every layer; returns the last calls' results per layer."""
    out = {}
    for op, t in ops:
        for i in range(cache.num_layers):
            k, v, q = kvq(rng, 1, t, groups)
            got = run_op(cache, i, op, k, v, q, groups)
            if refs is not None:
                ref = refs[i]
                want = ref.prefill(k, v, q) if op == "prefill" else ref.decode(k, v, q)
                if cache.is_sliding(i):
                    check_same(got, want)
                elif cache.full_method == "dense":  # a full layer returns every position, as given
                    check_same(got, (ref.k, ref.v))
            out[i] = got
    return out


@pytest.mark.parametrize("full_method", ["dense", "pqo4"])
def test_hybrid_routing_and_memory(rng, full_method):
    cache = hybrid(full_method)
    assert isinstance(cache, HybridCache) and "sliding_layers=2" in repr(cache)
    assert [cache.is_sliding(i) for i in range(4)] == [True, False, True, False]
    assert cache.cache_of(0) is cache.sliding and cache.cache_of(1) is cache.full
    # the reference of a full layer keeps everything (keep = infinity), as given
    storage = cache.sliding.storage
    assert storage == arraykv.caches.hybrid.default_window_storage(full_method)
    refs = [Ref(WINDOW, W_ROLLBACK, storage) if s else Ref(10**9, 0, "exact") for s in (True, False, True, False)]
    keep = WINDOW + W_ROLLBACK
    feed(rng, cache, [("prefill", 4)], refs)
    first = cache.memory_by_kind()
    feed(rng, cache, [("decode", 1)] * 6 + [("prefill", 7)] + [("decode", 1)] * 3, refs)
    mid = cache.memory_by_kind()
    used_full_mid = cache.full.used_bytes()
    feed(rng, cache, [("prefill", 20)] + [("decode", 1)] * 4, refs)
    last = cache.memory_by_kind()
    for i in range(4):
        assert cache.seq_len(i) == 44
        if cache.is_sliding(i):
            assert cache.sliding.held_tokens(i) == keep and cache.full.seq_len(i) == 0
            assert int(cache.dequantize(i).k.shape[2]) == keep
        else:
            assert cache.sliding.seq_len(i) == 0 and cache.sliding.held_tokens(i) == 0
            d = cache.dequantize(i)
            assert int(d.k.shape[2]) == 44
            if full_method == "dense":
                check_same((to_np(d.k), to_np(d.v)), (refs[i].k, refs[i].v))
    assert set(last) == {"full_attention", "sliding_attention"}
    assert cache.memory_usage() == sum(last.values())
    assert last["sliding_attention"] == cache.sliding.memory_usage() == mid["sliding_attention"]
    row = 2 * H * ROW_BYTES[storage]  # one position of k and v
    # besides the rows: the pq codec's rotation and codebooks, each layer's calibration (means and
    # channel weights of k and v, at most 4 float16 vectors, outlier channels), a float16 tail of
    # at most the held rows and the 8-byte record of the calibrating call
    side = 0
    if storage in POLAR_STORAGE:
        side = cache.sliding._fixed_nbytes() + 2 * (4 * H * D * 2 + H * D * 4 + keep * 2 * H * D * 2 + 8)
    assert last["sliding_attention"] <= 2 * (keep + max(16, keep // 4)) * row + side  # two layers, by the window
    assert last["full_attention"] == cache.full.memory_usage() >= mid["full_attention"] >= first["full_attention"] > 0
    assert cache.full.used_bytes() > used_full_mid  # the full layers grow with the sequence
    cache.reset()
    assert cache.memory_usage() == 0 and all(cache.seq_len(i) == 0 for i in range(4))


def test_hybrid_truncate_all_is_all_or_nothing(rng):
    # sliding layers keep 3 + 2 rows; full layers (pqo4, 2 rollback copies) reach back two tokens
    cache = hybrid(
        "pqo4", full_options={"rollback_tokens": 2}, window_options={"rollback_tokens": 8, "decode_path": "dequantized"}
    )
    feed(rng, cache, [("prefill", 40)] + [("decode", 1)] * 10)  # 50 tokens; window layers hold 11
    assert [cache.min_truncate_length(i) for i in range(4)] == [41, 48, 41, 48]
    # a full layer still reaches its uncalibrated first tokens (1 .. rollback copies + 2)
    assert cache.can_truncate(1, 3) and not cache.can_truncate(0, 3)
    assert cache.can_truncate(0, 45) and not cache.can_truncate(1, 45)
    before = snapshot(cache)
    for length in (45, 3, 51):  # the full layers cannot reach 45, the sliding ones not 3; too long
        with pytest.raises(ValueError):
            cache.truncate_all(length)
        assert_same_snapshot(snapshot(cache), before)
    with pytest.raises(ValueError):
        cache.truncate(0, 39)
    assert_same_snapshot(snapshot(cache), before)
    twin = cache.fork()
    twin.truncate_all(48)
    assert [twin.seq_len(i) for i in range(4)] == [48] * 4
    assert_same_snapshot(snapshot(cache), before)  # the fork only
    twin.truncate_all(0)
    assert twin.memory_usage() == 0 and all(twin.seq_len(i) == 0 for i in range(4))
    # the dense full layers reach anything: then the window layers decide
    dense = hybrid("dense")
    feed(rng, dense, [("prefill", 12)])
    before = snapshot(dense)
    assert [dense.can_truncate(i, 6) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match="layer 0"):
        dense.truncate_all(6)
    assert_same_snapshot(snapshot(dense), before)
    dense.truncate_all(9)
    assert [dense.seq_len(i) for i in range(4)] == [9] * 4


def test_hybrid_truncate_then_decode_equals_direct_build(rng):
    cache = hybrid("dense")
    refs = [
        Ref(WINDOW, W_ROLLBACK, cache.sliding.storage) if s else Ref(10**9, 0, "exact")
        for s in (True, False, True, False)
    ]
    feed(rng, cache, [("prefill", 5)] + [("decode", 1)] * 6, refs)
    length = cache.min_truncate_length(0)
    assert length == 11 - W_ROLLBACK - 1
    cache.truncate_all(length)
    base = hybrid("dense")
    for i, ref in enumerate(refs):
        ref = ref.truncated(length)
        base.prefill(i, ref.k, ref.v, np.zeros((1, 2 * H, length, D), np.float32))
    for _ in range(6):
        for i in range(4):
            k, v, q = kvq(rng, 1, 1, 2)
            check_same(run_op(cache, i, "decode", k, v, q, 2), run_op(base, i, "decode", k, v, q, 2))
    assert_same_snapshot(snapshot(cache), snapshot(base))


@pytest.mark.parametrize("full_method", ["dense", "pqo4"])
def test_hybrid_fork_snapshot_save_load(rng, tmp_path, full_method):
    cache = hybrid(full_method)
    feed(rng, cache, [("prefill", 9)] + [("decode", 1)] * 4)
    state = snapshot(cache)
    twin = cache.fork()
    feed(rng, twin, [("decode", 1)] * 7)
    assert_same_snapshot(snapshot(cache), state)
    recs = cache.snapshot()
    assert [r.length for r in recs] == [13] * 4
    name = "k" if cache.sliding.bits is None else "k_codes"
    assert int(recs[0].arrays[name].shape[2]) == WINDOW + W_ROLLBACK  # a sliding layer's record: its rows
    cache.save(tmp_path / "h.akv")
    loaded = arraykv.load(tmp_path / "h.akv")
    assert isinstance(loaded, HybridCache) and loaded.get_config() == cache.get_config()
    assert_same_snapshot(snapshot(loaded), state)
    for i in range(4):
        a, b = cache.dequantize(i), loaded.dequantize(i)
        np.testing.assert_array_equal(to_np(a.k), to_np(b.k))
        np.testing.assert_array_equal(to_np(a.v), to_np(b.v))
    feed(rng, cache, [("decode", 1)] * 3)
    cache.restore(recs)
    assert_same_snapshot(snapshot(cache), state)
    for _ in range(4):  # restored and loaded caches answer alike
        for i in range(4):
            k, v, q = kvq(rng, 1, 1, 2)
            a = cache.decode(i, k, v, q, config(2))
            b = loaded.decode(i, k, v, q, config(2))
            assert type(a) is type(b)
            if isinstance(a, arraykv.Dequantized):
                np.testing.assert_array_equal(to_np(a.result.k), to_np(b.result.k))
                np.testing.assert_array_equal(to_np(a.result.v), to_np(b.result.v))
            else:
                np.testing.assert_array_equal(to_np(a.output), to_np(b.output))
    assert_same_snapshot(snapshot(cache), snapshot(loaded))


def test_hybrid_restore_refuses_bad_records(rng):
    cache = hybrid("dense")
    feed(rng, cache, [("prefill", 9)])
    recs = cache.snapshot()
    feed(rng, cache, [("decode", 1)])
    before = snapshot(cache)
    bad_window = LayerRecord(
        length=9,
        batch=1,
        dtype="float32",
        arrays={"k": recs[0].arrays["k"][:, :, :1], "v": recs[0].arrays["v"][:, :, :1]},
    )
    bad_full = LayerRecord(length=8, batch=1, dtype="float32", arrays=recs[1].arrays)  # 9 rows for 8 tokens
    for bad in (
        [bad_window, *recs[1:]],  # the full part restores first, then must be put back
        [recs[0], bad_full, *recs[2:]],
        [recs[1], recs[0], *recs[2:]],  # records of the other kind
        recs[:3],
        recs + [None],
    ):
        with pytest.raises(ValueError):
            cache.restore(bad)
        assert_same_snapshot(snapshot(cache), before)


def test_hybrid_windows_take_the_global_outlier_options():
    c = hybrid("pqo4", full_options={"max_outliers": 1, "outlier_threshold": 6.0})
    assert c.sliding.options.max_outliers == 1 and c.sliding.options.outlier_threshold == 6.0
    c = hybrid("pqo4", full_options={"max_outliers": 1}, window_options={"max_outliers": 0})
    assert c.sliding.options.max_outliers == 0
    c = hybrid("pqo4", full_options={"max_outliers": 1}, window_options={"storage": "float16"})
    assert "max_outliers" not in c.window_options  # float16 windows take no codec options


def test_hybrid_bad_arguments():
    kw = dict(num_layers=3, num_kv_heads=H, head_dim=D, window=4)
    good = ("sliding_attention", "full_attention", "sliding_attention")
    with pytest.raises(ValueError, match="chunked_attention"):
        arraykv.make_cache("hybrid", layer_types=("sliding_attention", "chunked_attention", "full_attention"), **kw)
    with pytest.raises(ValueError, match="'local'"):
        arraykv.make_cache("hybrid", layer_types=("sliding_attention", "local", "full_attention"), **kw)
    with pytest.raises(ValueError, match="num_layers=3"):
        arraykv.make_cache("hybrid", layer_types=good[:2], **kw)
    with pytest.raises(ValueError, match="num_layers=3"):
        arraykv.make_cache("hybrid", layer_types=good + good[:1], **kw)
    for bad in ([1, 2, 3], ("full_attention", None, "full_attention"), "full_attention", None, 3):
        with pytest.raises(TypeError, match="layer_types"):
            arraykv.make_cache("hybrid", layer_types=bad, **kw)
    for method in ("window", "hybrid"):
        with pytest.raises(ValueError, match="full_method"):
            arraykv.make_cache("hybrid", layer_types=good, full_method=method, **kw)
    with pytest.raises(ValueError):
        arraykv.make_cache("hybrid", layer_types=good, full_method="no-such-method", **kw)
    with pytest.raises(TypeError, match="full_options"):
        arraykv.make_cache("hybrid", layer_types=good, full_options=[("bits", 4)], **kw)
    with pytest.raises(ValueError, match="window"):
        arraykv.make_cache("hybrid", layer_types=good, **{**kw, "window": 0})
    with pytest.raises(ValueError, match="storage"):
        arraykv.make_cache("hybrid", layer_types=good, window_options={"storage": "int4"}, **kw)


# -- 6. end to end: a tiny Gemma-3-like decoder ---------------------------------------------------
def _model():
    from tiny_models import WINDOW_GEMMA, decoder

    return decoder(WINDOW_GEMMA, seed=0)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.mark.parametrize(
    "prompt, chunk, window_options",
    [
        (1, 1, None),
        (4, 3, None),
        (9, 2, None),
        (24, 7, None),
        (12, 5, {"rollback_tokens": 0}),
        (30, None, None),
    ],
)
def test_decoder_chunked_prefill_and_decode_equal_forward(model, prompt, chunk, window_options):
    ids = np.random.default_rng(prompt).integers(0, 100, size=36).tolist()
    full = to_np(model.forward(ids))
    assert full.shape == (36, 100)
    cache = model.make_cache("dense", window_options=window_options)
    assert isinstance(cache, HybridCache) and cache.window == 5
    got = to_np(model.prefill(ids[:prompt], cache, chunk_size=chunk))
    np.testing.assert_allclose(got, full[:prompt], rtol=1e-5, atol=1e-5)
    for j in range(prompt, len(ids)):
        np.testing.assert_allclose(to_np(model.decode(ids[j], cache)), full[j], rtol=1e-5, atol=1e-5)
    keep = 5 + cache.sliding.rollback_tokens
    assert [cache.seq_len(i) for i in range(3)] == [36] * 3
    assert [cache.sliding.held_tokens(i) for i in range(2)] == [min(36, keep)] * 2


def test_decoder_pqo4_sliding_layers_hold_the_window(model):
    ids = np.random.default_rng(7).integers(0, 100, size=40).tolist()
    cache = model.make_cache("pqo4")
    assert cache.full_method == "pqo4" and cache.sliding.storage == "pq5"
    keep = 5 + cache.sliding.rollback_tokens
    logits = to_np(model.prefill(ids[:26], cache, chunk_size=8))
    assert np.isfinite(logits).all()
    for j in range(26, 40):
        assert np.isfinite(to_np(model.decode(ids[j], cache))).all()
        for i in (0, 1):
            assert cache.sliding.held_tokens(i) <= keep
    assert [cache.seq_len(i) for i in range(3)] == [40] * 3
    assert [cache.sliding.held_tokens(i) for i in range(2)] == [keep, keep]
    assert int(cache.dequantize(2).k.shape[2]) == 40 and cache.sliding.held_tokens(2) == 0
    mem = cache.memory_by_kind()
    assert 0 < mem["sliding_attention"] and mem["full_attention"] > 0


# -- 6. the fused decode of a compressed window ---------------------------------------------------
def rotating_keys(rng, batch, heads, start, t, d, mean_scale=3.0):
    """Keys whose mean turns with the position as rotary embeddings turn it (half-split pairs)."""
    half = d // 2
    theta = 10000.0 ** (-np.arange(half) / half)
    ang = np.arange(start, start + t)[:, None] * theta[None, :]
    m = mean_scale * np.ones(d)
    mean = np.concatenate(
        [m[:half] * np.cos(ang) - m[half:] * np.sin(ang), m[:half] * np.sin(ang) + m[half:] * np.cos(ang)], axis=-1
    )
    return (mean[None, None] + rng.standard_normal((batch, heads, t, d))).astype(np.float32)


def attend(q, k, v, scale):
    """Plain softmax attention of one query per head over K/V (grouped query heads)."""
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1).astype(np.float64), np.repeat(v, g, axis=1).astype(np.float64)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize(
    "storage, window, rollback, batch, groups, d",
    [
        ("pq4", 6, 2, 1, 2, 16),
        ("pq3", 9, 4, 2, 1, 32),
        ("pq2", 5, 0, 1, 3, 16),
        ("pq4", 40, 3, 2, 2, 64),
        ("pq5", 7, 2, 1, 2, 32),
        ("pq6", 5, 1, 2, 2, 16),
    ],
)
def test_fused_window_decode_equals_attention_over_its_rows(rng, storage, window, rollback, batch, groups, d):
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=d, window=window, rollback_tokens=rollback, storage=storage)
    fused = arraykv.make_cache("window", decode_path="fused", **kw)
    plain = arraykv.make_cache("window", decode_path="dequantized", **kw)
    scale = d**-0.5
    cfg = arraykv.AttendConfig(softmax_scale=scale, n_kv_groups=groups)
    pos = 0
    first = max(2 * window + 3, 40)  # enough tokens (>= 32) to fit a turning key mean
    for op, t in [("prefill", first)] + [("decode", 1)] * (window + 5) + [("prefill", 4)] + [("decode", 1)] * 6:
        k = rotating_keys(rng, batch, 2, pos, t, d)
        v = rng.standard_normal((batch, 2, t, d)).astype(np.float32)
        q = rng.standard_normal((batch, 2 * groups, t, d)).astype(np.float32)
        pos += t
        if op == "prefill":
            fused.prefill(0, k, v, q)
            plain.prefill(0, k, v, q)
            continue
        a = fused.decode(0, k, v, q, cfg)
        b = plain.decode(0, k, v, q, cfg)
        assert isinstance(a, arraykv.Fused) and isinstance(b, arraykv.Dequantized)
        assert int(b.result.k.shape[2]) == min(window, pos)
        want = attend(q, to_np(b.result.k), to_np(b.result.v), scale)
        np.testing.assert_allclose(to_np(a.output), want, rtol=2e-3, atol=2e-3)
    assert_same_snapshot(snapshot(fused), snapshot(plain))
    st = fused._states[0]
    assert st.calib is not None and st.calib.k_mean_freq is not None  # the calibration found the turning mean
