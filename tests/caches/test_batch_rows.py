"""select_rows (reorder, repeat, select batch rows) against the slow, obvious reference: a cache
fed the selected rows from the start.

A cache fed rows ``[a, b, c]`` and then given ``select_rows([2, 0, 0])`` must hold, bit for bit,
what a cache fed ``[c, a, a]`` from the start holds: the same ``layer_arrays``, the same
``dequantize``, and the same answers to every later call (decode outputs, prefill results),
for every method, for sliding-window layers and for a hybrid cache. ``lowrank`` and ``vq`` fit
one basis or codebook on every row of a layer: for them the reference is a cache *given* the
same fit, and a self-fitted cache keeps its fit through ``select_rows``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import arraykv
from arraykv.compressor import KVCacheCompressor, LowRank, VectorQuantization
from arraykv.protocol import AttendConfig, Fused

L, H, D, QH = 3, 2, 32, 4
#: The keys' mean, the same in every row, large enough that no subset of rows fits a rotating
#: mean (a polar layer's rotary layout is one choice for all its rows).
MEAN = np.linspace(-1.5, 1.5, D, dtype=np.float32)
#: A prompt long enough for every window to spill and every int key group to fill, then decodes.
PROMPT, STEPS, MORE = 80, 12, 9


def _data(seed: int, rows: int, tokens: int):
    """K/V/Q of ``rows`` sequences, each row drawn alone (so a row's data does not depend on the batch)."""
    out = []
    for r in range(rows):
        g = np.random.default_rng([seed, r])
        k = g.standard_normal((L, H, tokens, D), dtype=np.float32)
        k[..., 3] *= 8.0  # an outlier channel, as real keys have
        k += MEAN  # a mean that does not turn with the position (see the module docstring)
        v = g.standard_normal((L, H, tokens, D), dtype=np.float32)
        q = g.standard_normal((L, QH, tokens, D), dtype=np.float32)
        out.append((k, v, q))
    return [np.stack([o[i] for o in out], axis=1) for i in range(3)]  # (L, rows, heads, tokens, D)


def _feed(cache, k, v, q, start: int, stop: int, *, prompt: bool) -> list:
    """Prefill tokens ``start:stop`` (one call per layer) or decode them one at a time; the answers (copied)."""
    got = []
    cfg = AttendConfig(D**-0.5, QH // H)
    if prompt:
        for i in range(L):
            r = cache.prefill(i, k[i][:, :, start:stop], v[i][:, :, start:stop], q[i][:, :, start:stop])
            got += [np.array(r.k), np.array(r.v)]  # copies: a window's result is a view of its rows
        return got
    for t in range(start, stop):
        for i in range(L):
            r = cache.decode(i, k[i][:, :, t : t + 1], v[i][:, :, t : t + 1], q[i][:, :, t : t + 1], cfg)
            got += [np.array(r.output)] if isinstance(r, Fused) else [np.array(r.result.k), np.array(r.result.v)]
    return got


def _state(cache) -> list:
    out = []
    for i in range(L):
        arrays = cache.layer_arrays(i)
        out.append({n: np.asarray(a) for n, a in arrays.items()})
        r = cache.dequantize(i)
        out.append({"k": np.asarray(r.k), "v": np.asarray(r.v)})
        out.append({"seq_len": cache.seq_len(i), "stable": cache.stable_length(i)})
    return out


def _assert_same(a, b, what: str):
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys(), what
            for n in x:
                xn, yn = np.asarray(x[n]), np.asarray(y[n])
                assert xn.shape == yn.shape and xn.dtype == yn.dtype, (what, n)
                np.testing.assert_array_equal(xn, yn, err_msg=f"{what}: {n}")
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def _make(method: str, **extra):
    if method == "hybrid":
        return arraykv.make_cache(
            "hybrid",
            num_layers=L,
            num_kv_heads=H,
            head_dim=D,
            layer_types=("sliding_attention", "full_attention", "sliding_attention"),
            window=24,
            full_method=extra.pop("full_method", "pqo4"),
            **extra,
        )
    if method == "window":
        extra.setdefault("window", 24)
    return arraykv.make_cache(method, num_layers=L, num_kv_heads=H, head_dim=D, **extra)


def _fit(method: str):
    """A fit of ``method`` on data of its own (lowrank, vq), for a cache given it."""
    k, v, _ = _data(99, 2, 64)
    k, v = k[0].reshape(2, H, 64, D), v[0].reshape(2, H, 64, D)
    kind = LowRank(rank=8) if method == "lowrank" else VectorQuantization(codebook_size=16, sub_dim=4, seed=1)
    return KVCacheCompressor(kind).fit(k, v)


CASES = [m for m in arraykv.available_methods()] + [
    "window",
    "window/pq5",
    "hybrid",
    "hybrid/int4",
    "hybrid/dense",
]


def _options(case: str) -> tuple[str, dict]:
    method, _, part = case.partition("/")
    if method == "window":
        return method, ({"storage": part} if part else {})
    if method == "hybrid":
        return method, ({"full_method": part} if part else {})
    if method in ("lowrank", "vq"):
        return method, {"calibration": _fit(method)}
    return method, {}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [[2, 0, 0], [1], [0, 0, 1, 1, 2, 2]], ids=["reorder", "select", "repeat"])
def test_selected_rows_hold_what_a_cache_fed_those_rows_holds(case, rows):
    method, opts = _options(case)
    k, v, q = _data(1, 3, PROMPT + STEPS + MORE)
    src = _make(method, **opts)
    _feed(src, k, v, q, 0, PROMPT, prompt=True)
    _feed(src, k, v, q, PROMPT, PROMPT + STEPS, prompt=False)
    src.select_rows(rows)
    assert src.batch_size() == len(rows)

    ref = _make(method, **opts)
    ks, vs, qs = k[:, rows], v[:, rows], q[:, rows]
    _feed(ref, ks, vs, qs, 0, PROMPT, prompt=True)
    _feed(ref, ks, vs, qs, PROMPT, PROMPT + STEPS, prompt=False)
    _assert_same(_state(src), _state(ref), f"{case} after select_rows({rows})")
    # later calls: decodes, then a prefill of several tokens, answer the same
    end = PROMPT + STEPS + MORE
    got = _feed(src, ks, vs, qs, PROMPT + STEPS, end - 3, prompt=False)
    want = _feed(ref, ks, vs, qs, PROMPT + STEPS, end - 3, prompt=False)
    _assert_same(got, want, f"{case}: decodes after select_rows")
    got = _feed(src, ks, vs, qs, end - 3, end, prompt=True)
    want = _feed(ref, ks, vs, qs, end - 3, end, prompt=True)
    _assert_same(got, want, f"{case}: prefill after select_rows")
    _assert_same(_state(src), _state(ref), f"{case} at the end")


@pytest.mark.parametrize("method", ["lowrank", "vq"])
def test_a_fit_of_every_row_is_kept_and_each_row_taken(method):
    """A self-fitted lowrank/vq layer: the fit (shared by the rows) stays, per-row arrays are the rows'."""
    opts = {"codebook_size": 16, "sub_dim": 4, "min_calibration": 64} if method == "vq" else {"rank": 8}
    k, v, q = _data(2, 3, PROMPT + STEPS)
    cache = _make(method, **opts)
    _feed(cache, k, v, q, 0, PROMPT, prompt=True)
    _feed(cache, k, v, q, PROMPT, PROMPT + STEPS, prompt=False)
    before = _state(cache)
    cache.select_rows([2, 0])
    after = _state(cache)
    shared = ("k_basis", "v_basis", "k_mean", "v_mean", "k_centroids", "v_centroids")
    for layer in range(L):
        b, a = before[3 * layer], after[3 * layer]
        assert b.keys() == a.keys()
        for name in b:
            if name in shared:
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)
            elif name != "fixed_end":
                np.testing.assert_array_equal(a[name], b[name][[2, 0]], err_msg=name)
        for side in (3 * layer + 1,):
            for name in ("k", "v"):
                np.testing.assert_array_equal(after[side][name], before[side][name][[2, 0]])


@pytest.mark.parametrize("method", ["pqo4", "hybrid"])
def test_bad_indices_are_refused_and_change_nothing(method):
    k, v, q = _data(3, 2, 40)
    cache = _make(method)
    _feed(cache, k, v, q, 0, 40, prompt=True)
    before = _state(cache)
    for bad, err, match in [
        ([0, 2], ValueError, r"\[0, 2\).*received 2"),
        ([], ValueError, "at least one row"),
        ([-1], ValueError, ">= 0"),
        ([0.0], TypeError, "integer"),
        ([True], TypeError, "integer"),
        (np.zeros((1, 2), dtype=np.int64), ValueError, "1-D"),
        ("01", TypeError, "sequence"),
        (3, TypeError, "sequence"),
    ]:
        with pytest.raises(err, match=match):
            cache.select_rows(bad)
    _assert_same(_state(cache), before, "after refused selections")
    cache.select_rows(np.array([1, 0]))  # any 1-D integer array
    cache.select_rows(range(2))
    assert cache.batch_size() == 2


def test_an_empty_cache_and_empty_layers_stay_empty():
    cache = _make("pqo4")
    cache.select_rows([0, 0, 5])  # nothing stored: nothing to check a row against
    assert cache.batch_size() == 0 and cache.layer_arrays(0) == {}
    k, v, q = _data(4, 2, 10)
    cache.prefill(1, k[1], v[1], q[1])  # one layer only
    cache.select_rows([1, 1, 0])
    assert cache.batch_size() == 3 and cache.seq_len(0) == 0 and cache.seq_len(1) == 10


def test_a_failure_part_way_leaves_every_layer_as_it_was():
    """A MemoryError building the last layer: the layers built before it are not put in place."""
    k, v, q = _data(5, 3, PROMPT)
    cache = _make("hybrid")
    _feed(cache, k, v, q, 0, PROMPT, prompt=True)
    before = _state(cache)
    real = cache.sliding._restore_layer
    calls = []

    def fail_on_the_last(*args):
        calls.append(1)
        if len(calls) == 2:  # the sliding part's second layer, after the global part was built
            raise MemoryError("injected")
        return real(*args)

    cache.sliding._restore_layer = fail_on_the_last
    with pytest.raises(MemoryError):
        cache.select_rows([2, 1, 0])
    del cache.sliding._restore_layer
    _assert_same(_state(cache), before, "after a failed selection")


@pytest.mark.parametrize("method", ["pqo4", "hybrid"])
def test_a_transaction_rolled_back_puts_the_rows_back(method):
    k, v, q = _data(8, 3, PROMPT + 1)
    cache = _make(method)
    _feed(cache, k, v, q, 0, PROMPT, prompt=True)
    before = _state(cache)
    with pytest.raises(KeyboardInterrupt), cache.transaction():
        cache.select_rows([2, 0])
        _feed(cache, k[:, [2, 0]], v[:, [2, 0]], q[:, [2, 0]], PROMPT, PROMPT + 1, prompt=False)
        raise KeyboardInterrupt
    _assert_same(_state(cache), before, "after the rollback")
    assert cache.batch_size() == 3


def test_selection_waits_for_a_call_in_flight():
    """select_rows takes every layer lock: a decode holding a layer's lock finishes first."""
    k, v, q = _data(6, 2, PROMPT + 1)
    cache = _make("pqo4")
    _feed(cache, k, v, q, 0, PROMPT, prompt=True)
    entered, release = threading.Event(), threading.Event()
    real = cache._decode

    def slow_decode(*args):
        entered.set()
        release.wait(5)
        return real(*args)

    cache._decode = slow_decode
    t = threading.Thread(target=_feed, args=(cache, k, v, q, PROMPT, PROMPT + 1), kwargs={"prompt": False})
    t.start()
    entered.wait(5)
    done = threading.Event()
    s = threading.Thread(target=lambda: (cache.select_rows([1, 0]), done.set()))
    s.start()
    assert not done.wait(0.2)  # blocked on layer 0's lock
    release.set()
    t.join(5)
    s.join(5)
    assert done.is_set() and all(cache.seq_len(i) == PROMPT + 1 for i in range(L))


@pytest.mark.parametrize("method", ["dense", "int4", "pqo4", "hybrid"])
def test_rows_of_every_namespace(xp, method):
    """NumPy, array_api_strict (and CuPy on a GPU): selected rows hold what a cache fed them holds."""
    from conftest import asarray, to_np

    if method == "hybrid" and not hasattr(xp, "float16"):
        pytest.skip("the sliding layers' pq5 windows need float16, which this namespace lacks")
    k, v, q = _data(7, 3, PROMPT)
    runs = []
    for rows, select in (([0, 1, 2], [2, 0, 0]), ([2, 0, 0], None)):
        cache = _make(method)
        for i in range(L):
            cache.prefill(i, *(asarray(xp, a[i][rows]) for a in (k, v, q)))
        if select is not None:
            cache.select_rows(select)
        runs.append([{n: to_np(a) for n, a in cache.layer_arrays(i).items()} for i in range(L)])
    _assert_same(runs[0], runs[1], f"{method} in {xp.__name__}")
