"""Regressions of a hostile review: edited files (with a recomputed SHA-256) and mismatched
snapshots are refused before a cache is built from them, and a refused restore changes nothing.

Each case once loaded and then crashed the interpreter at the first decode, raised a bare
NumPy/Numba error, allocated what the header asked, or returned non-finite output.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import arraykv
from arraykv.storage.cache_file import CacheFileError

from cache_contract import assert_same_snapshot, rotary_embed, snapshot
from cache_files import array_of, edit_file, serialize_file, set_array


def _saved(tmp_path, method, *, batch=1, heads=2, head_dim=32, tokens=60, **options):
    """A cache of ``method`` whose layer 0 holds sinks, codes, a window, a calibration and
    rollback copies (layer 1 stays empty), and the path it was saved to."""
    rng = np.random.default_rng(0)
    cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=heads, head_dim=head_dim, **options)
    mean = rng.standard_normal((batch, heads, 1, head_dim)) * 2.0
    k = rotary_embed(mean + rng.standard_normal((batch, heads, tokens, head_dim)) * 0.5).astype(np.float32)
    v = rng.standard_normal((batch, heads, tokens, head_dim)).astype(np.float32)
    q = rng.standard_normal((batch, 2 * heads, tokens, head_dim)).astype(np.float32)
    cache.prefill(0, k, v, q)
    path = tmp_path / f"{method}.akv"
    cache.save(path)
    return cache, path


def _refused(path, match=None):
    with pytest.raises(CacheFileError, match=match):
        arraykv.load(path)


@pytest.mark.parametrize("method", ["pqo4", "tq3", "pq3"])
@pytest.mark.parametrize("saved_batch, said", [(1, 2), (2, 1)])
def test_a_layer_header_whose_batch_the_arrays_do_not_have_is_refused(tmp_path, method, saved_batch, said):
    _, path = _saved(tmp_path, method, batch=saved_batch)

    def edit(f):
        f["layers"][0]["batch"] = said

    edit_file(path, edit)
    _refused(path, f"must have {said} on axis 0")


@pytest.mark.parametrize(
    "key, value",
    [
        ("head_dim", 1 << 20),
        ("head_dim", 5000),
        ("num_kv_heads", 1 << 16),
        ("max_tokens", 1 << 40),
        ("max_tokens", 1 << 30),
    ],
)
def test_a_small_file_declaring_a_huge_geometry_is_refused_before_anything_is_allocated(tmp_path, key, value):
    for method in ("pqo4", "tq3", "dense", "int4"):
        cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=2, head_dim=32)
        path = tmp_path / "empty.akv"
        cache.save(path)  # two empty layers: nothing in the file says how large a layer is

        def edit(f):
            f["config"][key] = value

        edit_file(path, edit)
        assert path.stat().st_size < 2000
        t0 = time.perf_counter()
        _refused(path, key)
        assert time.perf_counter() - t0 < 1.0


def test_max_tokens_below_a_layer_length_is_refused(tmp_path):
    cache, path = _saved(tmp_path, "pqo4")

    def edit(f):
        f["config"]["max_tokens"] = cache.seq_len(0) - 1

    edit_file(path, edit)
    _refused(path, "max_tokens")


@pytest.mark.parametrize("method", ["dense", "int4", "int2", "pqo4", "tq3", "lowrank", "vq"])
def test_restore_of_a_snapshot_of_two_kv_heads_into_a_cache_of_three_is_refused(method):
    rng = np.random.default_rng(1)
    two = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=32)
    three = arraykv.make_cache(method, num_layers=1, num_kv_heads=3, head_dim=32)
    for cache, h in ((two, 2), (three, 3)):
        x = rng.standard_normal((1, h, 80, 32)).astype(np.float32)
        cache.prefill(0, x, x, np.concatenate([x, x], axis=1))
    before = snapshot(three)
    with pytest.raises(ValueError, match="must have 3 on axis"):
        three.restore(two.snapshot())
    assert_same_snapshot(snapshot(three), before)
    x = rng.standard_normal((1, 3, 1, 32)).astype(np.float32)  # and it still works
    three.decode(0, x, x, np.concatenate([x, x], axis=1), arraykv.AttendConfig(softmax_scale=0.2, n_kv_groups=2))


@pytest.mark.parametrize("code", [12, 15])
def test_vq_codes_beyond_the_codebook_are_refused(tmp_path, code):
    _, path = _saved(tmp_path, "vq", tokens=80, codebook_size=12)

    def edit(f):
        codes = array_of(f, 0, "k_codes")
        codes[0, 1, 3, 2] = (codes[0, 1, 3, 2] & 0xF0) | code  # a 4-bit code in the low nibble

    edit_file(path, edit)
    _refused(path, "beyond the codebook of 12")


@pytest.mark.parametrize(
    "idx, why", [([3, 32], "above 31"), ([-1, 4], "below 0"), ([9, 4], "ascending"), ([4, 4], "ascending")]
)
def test_outlier_channels_out_of_range_or_order_are_refused(tmp_path, idx, why):
    _, path = _saved(tmp_path, "pqo4", outliers=2)

    def edit(f):
        array_of(f, 0, "k_outlier_idx")[0, 1] = idx

    edit_file(path, edit)
    _refused(path, why)


def test_outlier_channels_as_many_as_head_dim_are_refused(tmp_path):
    _, path = _saved(tmp_path, "pqo4", head_dim=8, outliers=2)

    def edit(f):
        set_array(f, 0, "k_outlier_idx", np.tile(np.arange(8, dtype=np.int32), (1, 2, 1)))
        set_array(f, 0, "k_outliers", np.zeros(array_of(f, 0, "k_norms").shape + (8,), np.float16))

    edit_file(path, edit)
    _refused(path, "fewer than head_dim=8")


@pytest.mark.parametrize("method", ["pqo4", "int4", "lowrank"])
@pytest.mark.parametrize("value", [-1, 61, 1 << 40])
def test_fixed_end_out_of_range_is_refused(tmp_path, method, value):
    _, path = _saved(tmp_path, method)

    def edit(f):
        array_of(f, 0, "fixed_end")[0] = value

    edit_file(path, edit)
    _refused(path, "fixed_end")


@pytest.mark.parametrize(
    "method, name, value, match",
    [
        ("pqo4", "k_scale", 0.0, "below 0.0625"),  # a kernel divides by the key channel weights
        ("pqo4", "k_norms", np.nan, "NaN"),
        ("tq3", "k_mean_freq", 1e30, "above 3.14"),
        ("int4", "v_scale", 6e4, "reconstruct"),  # float32 layer of 65504 · 15: fine; float16 below
        ("lowrank", "k_basis", 1e30, "above"),
        ("vq", "v_centroids", np.inf, "infinity"),
    ],
)
def test_codec_parameters_out_of_range_are_refused(tmp_path, method, name, value, match):
    if name == "v_scale":  # the largest reconstruction must fit the layer's dtype (float16 here)
        rng = np.random.default_rng(2)
        cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=32)
        x = rng.standard_normal((1, 2, 40, 32)).astype(np.float16)
        cache.prefill(0, x, x, x)
        path = tmp_path / "half.akv"
        cache.save(path)
    else:
        _, path = _saved(tmp_path, method, tokens=80)

    def edit(f):
        a = array_of(f, 0, name)
        a.reshape(-1)[:3] = value

    edit_file(path, edit)
    _refused(path, match)


def test_int_exponents_out_of_range_are_refused(tmp_path):
    rng = np.random.default_rng(3)
    cache = arraykv.make_cache("int4", num_layers=1, num_kv_heads=2, head_dim=32)
    x = (rng.standard_normal((1, 2, 40, 32)) * 1e-5).astype(np.float32)  # small data: units of 2**-17
    cache.prefill(0, x, x, x)
    path = tmp_path / "exp.akv"
    cache.save(path)

    def edit(f):
        array_of(f, 0, "exp")[:] = [1000, -17]

    edit_file(path, edit)
    _refused(path, "exp")


def test_rotary_pairs_must_be_a_rotary_layout(tmp_path):
    _, path = _saved(tmp_path, "pqo4")

    def edit(f):
        array_of(f, 0, "k_mean_pairs")[0] = [0, 0]

    edit_file(path, edit)
    _refused(path, "rotary layout")


@pytest.mark.parametrize("method", ["pqo4", "int2", "vq"])
def test_token_counts_that_agree_with_each_other_but_not_with_the_cache_are_refused(tmp_path, method):
    _, path = _saved(tmp_path, method, tokens=80)

    def edit(f):  # one token more in every array of the window and in the length: a window larger than the cache keeps
        f["layers"][0]["length"] += 1
        for e in f["arrays"]:
            if e[0] == 0 and e[1] in ("k_window", "v_window"):
                e[2] = np.concatenate([e[2], e[2][:, :, -1:]], axis=2)

    edit_file(path, edit)
    _refused(path)


def test_the_edited_files_are_well_formed(tmp_path):
    """The edits above change only content: an unedited round trip through the helpers loads."""
    cache, path = _saved(tmp_path, "tq3", tokens=80, outliers=2)
    edit_file(path, lambda f: None)
    back = arraykv.load(path)
    assert_same_snapshot(snapshot(back), snapshot(cache))
    assert serialize_file  # the helper the fuzzer shares


@pytest.mark.parametrize(
    "edits",
    [
        {"k_norms": 65504.0, "k_scale": 0.0625},
        {"v_norms": 65504.0, "v_mean": 65504.0},
        {"k_norms": 65504.0, "k_mean": 65504.0},
    ],
)
def test_a_float16_window_whose_finite_parts_decode_past_float16_is_refused(tmp_path, edits):
    """A pq window layer of float16 callers: lengths, means and weights each in their range, but
    the keys or values they decode to beyond float16; the restore decodes the window once and
    refuses (and a refused restore changes nothing)."""
    rng = np.random.default_rng(1)
    cache = arraykv.make_cache("window", num_layers=1, num_kv_heads=2, head_dim=32, window=12, storage="pq4")
    k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float16) for _ in range(2))
    cache.prefill(0, k, v, rng.standard_normal((1, 2, 40, 32)).astype(np.float16))
    path = tmp_path / "w.akv"
    cache.save(path)

    _fill_arrays(path, edits)
    _refused(path, BEYOND)
    before = snapshot(cache)
    rec = cache.snapshot()[0]
    bad = dict(rec.arrays)
    for name, value in edits.items():
        bad[name] = np.full_like(bad[name], value)
    with pytest.raises(ValueError, match=BEYOND):
        cache.restore([type(rec)(length=rec.length, batch=rec.batch, dtype=rec.dtype, arrays=bad)])
    assert_same_snapshot(snapshot(cache), before)


@pytest.mark.parametrize(
    "method, edits", [("pqo4", {"k_mean": 65504.0}), ("tq3", {"k_mean": 65504.0}), ("lowrank", {"k_coef": 65504.0})]
)
def test_a_float16_layer_whose_parts_decode_past_float16_is_refused(tmp_path, method, edits):
    """Each part inside its dtype's range, the reconstruction beyond float16: refused on load
    (the restore of a half-precision layer decodes it once)."""
    rng = np.random.default_rng(2)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=32)
    mean = rng.standard_normal((1, 2, 1, 32)) * 4.0
    k = rotary_embed(mean + rng.standard_normal((1, 2, 300, 32))).astype(np.float16)
    v = rng.standard_normal((1, 2, 300, 32)).astype(np.float16)
    cache.prefill(0, k, v, rng.standard_normal((1, 4, 300, 32)).astype(np.float16))
    path = tmp_path / "h.akv"
    cache.save(path)
    assert arraykv.load(path).seq_len(0) == 300

    _fill_arrays(path, edits)
    _refused(path, BEYOND)


#: The refusals of such a layer: its stored arrays decode past float16, or (checked first, by
#: :mod:`arraykv.caches.restore_checks`) its means leave no float16 room for the next token.
BEYOND = "beyond the range of float16|no float16 room"


def _fill_arrays(path, edits: dict) -> None:
    """Set every value of layer 0's arrays named in ``edits`` to the value given (checksum recomputed)."""

    def edit(f):
        for name, value in edits.items():
            a = array_of(f, 0, name).copy()
            a[...] = value
            set_array(f, 0, name, a)

    edit_file(path, edit)
