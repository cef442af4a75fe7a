"""The streaming ``lowrank`` and ``vq`` caches: their fit, their codes, their window and sinks."""

import numpy as np
import pytest

import arraykv
from arraykv import KVCacheCompressor, LowRank, VectorQuantization
from arraykv.caches.sliding import SPARE_ROWS

from cache_contract import assert_same_snapshot, attend, random_kvq, snapshot
from conftest import asarray, to_np

H, D = 2, 32


def make(method, **kw):
    """A cache with no float16 window or sinks unless asked: every token goes through the codec."""
    opts = dict(num_layers=2, num_kv_heads=H, head_dim=D, residual_window=0, sink_tokens=0)
    opts.update(kw)
    return arraykv.make_cache(method, **opts)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(((got - want) ** 2).sum() / (want**2).sum())


def low_rank_data(rng, b, t, rank=6, noise=0.05):
    """Keys/values near a rank-``rank`` affine subspace per head, plus an outlier channel."""
    basis = rng.standard_normal((H, rank, D))
    x = np.einsum("bhtr,hrd->bhtd", rng.standard_normal((b, H, t, rank)), basis)
    x += noise * rng.standard_normal(x.shape) + rng.standard_normal((1, H, 1, D))
    x[..., 3] *= 8.0
    return x.astype(np.float32)


# -- lowrank --------------------------------------------------------------------------------
def test_lowrank_fit_is_the_compressors_fit_on_the_same_tokens(xp, rng):
    k, v = low_rank_data(rng, 2, 80), low_rank_data(rng, 2, 80)
    q = rng.standard_normal((2, H, 80, D)).astype(np.float32)
    cache = make("lowrank", rank=8)
    first = cache.prefill(0, asarray(xp, k), asarray(xp, v), asarray(xp, q))
    np.testing.assert_array_equal(to_np(first.k), k)  # the first prefill is returned exactly
    assert cache.is_fitted(0) and not cache.is_fitted(1)
    comp = KVCacheCompressor(LowRank(rank=8)).fit(k, v)
    want_k, want_v = comp.decompress_kv(comp.compress_kv(k, v))
    got = cache.dequantize(0)
    # Same basis, float16 coefficients: the reconstructions agree to float16 rounding.
    assert rel_err(to_np(got.k), want_k) < 1e-5 and rel_err(to_np(got.v), want_v) < 1e-5
    # ... and the error is the Eckart-Young optimum of the fitted tokens.
    samples = np.transpose(k, (1, 0, 2, 3)).reshape(H, -1, D)
    centred = samples - samples.mean(axis=1, keepdims=True)
    tail = (np.linalg.svd(centred.astype(np.float64), compute_uv=False)[:, 8:] ** 2).sum()
    optimum = tail / (samples.astype(np.float64) ** 2).sum()
    assert rel_err(to_np(got.k), k) == pytest.approx(optimum, rel=0.02, abs=1e-6)
    arrays = cache.layer_arrays(0)
    assert arrays["k_coef"].shape == (2, H, 80, 8) and arrays["k_basis"].shape == (H, D, 8)


def test_lowrank_before_its_fit_keeps_float16_then_encodes_everything(rng):
    cache = make("lowrank", rank=4)  # min_calibration = head_dim = 32 vectors per head
    k, v, q = random_kvq(rng, np, 1, H, 1, 20, D)
    cache.prefill(0, k, v, q)
    assert not cache.is_fitted(0)
    np.testing.assert_array_equal(to_np(cache.dequantize(0).k), k.astype(np.float16).astype(np.float32))
    cfg = arraykv.AttendConfig(D**-0.5)
    ks = [k]
    for _ in range(12):  # decodes reach 32 vectors: the layer fits on all 32 and encodes them
        k1, v1, q1 = random_kvq(rng, np, 1, H, 1, 1, D)
        ks.append(k1)
        cache.decode(0, k1, v1, q1, cfg)
    assert cache.is_fitted(0) and cache.seq_len(0) == 32
    a = cache.layer_arrays(0)
    assert a["k_coef"].shape == (1, H, 32, 4) and a["k_window"].shape == (1, H, 0, D)
    allk = np.concatenate(ks, axis=2)
    comp = KVCacheCompressor(LowRank(rank=4)).fit(allk.astype(np.float16).astype(np.float32), allk)
    want = comp.decompress_kv(comp.compress_kv(allk, allk))[0]
    assert rel_err(to_np(cache.dequantize(0).k), want) < 1e-4


def test_lowrank_window_and_sinks_stay_float16(rng):
    cache = make("lowrank", rank=4, residual_window=5, sink_tokens=3)
    k, v, q = random_kvq(rng, np, 1, H, 1, 64, D)
    cache.prefill(0, k, v, q)
    cfg = arraykv.AttendConfig(D**-0.5)
    ks = [k]
    for _ in range(7):
        k1, v1, q1 = random_kvq(rng, np, 1, H, 1, 1, D)
        ks.append(k1)
        cache.decode(0, k1, v1, q1, cfg)
    allk = np.concatenate(ks, axis=2)
    a = cache.layer_arrays(0)
    assert a["k_sink"].shape[2] == 3 and a["k_window"].shape[2] == 5 and a["k_coef"].shape[2] == 71 - 8
    got = to_np(cache.dequantize(0).k)
    h16 = allk.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got[:, :, :3], h16[:, :, :3])
    np.testing.assert_array_equal(got[:, :, -5:], h16[:, :, -5:])
    # The middle is projected on a basis fitted without the sinks: rank 4 of 32 random dims.
    assert 0.6 < rel_err(got[:, :, 3:-5], allk[:, :, 3:-5]) < 0.95


def test_lowrank_given_calibration_encodes_from_the_first_token(xp, rng):
    cal_k, cal_v = low_rank_data(rng, 1, 200), low_rank_data(rng, 1, 200)
    comp = KVCacheCompressor(LowRank(rank=6)).fit(cal_k, cal_v)
    cache = make("lowrank", calibration=comp)
    assert cache.rank == 16  # the option; the given basis decides what is stored
    k, v = low_rank_data(rng, 1, 3), low_rank_data(rng, 1, 3)
    cache.prefill(1, asarray(xp, k), asarray(xp, v), asarray(xp, k))
    assert cache.is_fitted(1)
    a = cache.layer_arrays(1)
    assert a["k_coef"].shape == (1, H, 3, 6) and a["k_window"].shape[2] == 0
    want_k, want_v = comp.decompress_kv(comp.compress_kv(k, v))
    got = cache.dequantize(1)
    assert rel_err(to_np(got.k), want_k) < 1e-5 and rel_err(to_np(got.v), want_v) < 1e-5


def test_lowrank_memory_is_what_the_rank_says(rng):
    cache = make("lowrank", rank=8, num_layers=1)
    k, v, q = random_kvq(rng, np, 1, H, 1, 1024, D)
    cache.prefill(0, k, v, q)
    per_token = 2 * H * 8 * 2  # k and v coefficients, float16
    side = 2 * H * (D * 8 + D) * 4  # bases and means, float32
    rollback = 2 * H * 16 * D * 2 + 8  # float16 copies of the last 16 encoded tokens, the record of the fit
    # the window and the rollback copies slide in buffers with SPARE_ROWS rows of room each
    spare = 2 * (2 * H * SPARE_ROWS * D * 2)
    assert cache.memory_usage() == per_token * 1024 + side + rollback + spare
    assert cache.memory_usage() - spare == cache.used_bytes() + cache.rollback_bytes()
    dense16 = 2 * H * D * 2 * 1024
    # 8 of 32 directions, plus the bases
    assert (cache.memory_usage() - spare - cache.rollback_bytes()) / dense16 < 0.27


# -- vq ---------------------------------------------------------------------------------------
def test_vq_codebooks_and_codes_are_the_compressors(xp, rng):
    k, v, q = random_kvq(rng, np, 1, H, 1, 96, D)
    cache = make("vq", codebook_size=16, sub_dim=4, min_calibration=64, seed=3)
    cache.prefill(0, asarray(xp, k), asarray(xp, v), asarray(xp, q))
    assert cache.is_fitted(0)
    comp = KVCacheCompressor(VectorQuantization(codebook_size=16, sub_dim=4, seed=3)).fit(k, v)
    c = comp.compress_kv(k, v)
    a = cache.layer_arrays(0)
    np.testing.assert_allclose(to_np(a["k_centroids"]), to_np(comp._fit["k"].centroids), rtol=1e-5, atol=1e-6)
    assert to_np(a["k_codes"]).dtype == np.uint8 and a["k_codes"].shape == (1, H, 96, D // 4 * 4 // 8)
    want_k, want_v = comp.decompress_kv(c)
    got = cache.dequantize(0)
    assert rel_err(to_np(got.k), want_k) < 1e-8 and rel_err(to_np(got.v), want_v) < 1e-8
    # 16 centroids in 4 dims of Gaussian data: well under the variance, above the 1-bit/value bound.
    assert 0.15 < rel_err(to_np(got.k), k) < 0.5


def test_vq_given_codebooks_and_decode_attention(rng):
    cal = rng.standard_normal((1, H, 512, D)).astype(np.float32)
    comp = KVCacheCompressor(VectorQuantization(codebook_size=64, sub_dim=2)).fit(cal, cal)
    cache = make("vq", calibration=[comp, None])
    k, v, q = random_kvq(rng, np, 1, H, 1, 10, D)
    cache.prefill(0, k, v, q)
    cache.prefill(1, k, v, q)
    assert cache.is_fitted(0) and not cache.is_fitted(1)
    k1, v1, q1 = random_kvq(rng, np, 1, H, 2, 1, D)
    cfg = arraykv.AttendConfig(D**-0.5, 2)
    out = cache.decode(0, k1, v1, q1, cfg)
    assert isinstance(out, (arraykv.Fused, arraykv.Dequantized))
    ck, cv = comp.decompress_kv(comp.compress_kv(np.concatenate([k, k1], 2), np.concatenate([v, v1], 2)))
    want = arraykv.attention(q1, ck, cv, softmax_scale=D**-0.5)
    np.testing.assert_allclose(to_np(attend(out, q1, D**-0.5)), want, rtol=1e-4, atol=1e-5)


def test_vq_save_load_continues_exactly(tmp_path, rng):
    cache = make("vq", codebook_size=8, min_calibration=16, residual_window=2)
    k, v, q = random_kvq(rng, np, 2, H, 1, 20, D)
    cache.prefill(0, k, v, q)
    path = tmp_path / "c.akv"
    cache.save(path)
    loaded = arraykv.load(path)
    assert_same_snapshot(snapshot(cache), snapshot(loaded))
    cfg = arraykv.AttendConfig(D**-0.5)
    for _ in range(3):
        k1, v1, q1 = random_kvq(rng, np, 2, H, 1, 1, D)
        a, b = cache.decode(0, k1, v1, q1, cfg), loaded.decode(0, k1, v1, q1, cfg)
        np.testing.assert_array_equal(to_np(attend(a, q1, D**-0.5)), to_np(attend(b, q1, D**-0.5)))
    assert_same_snapshot(snapshot(cache), snapshot(loaded))


# -- decode paths ------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lowrank", "vq"])
@pytest.mark.parametrize("b,g,window,sinks,prefill", [(1, 1, 0, 0, 80), (3, 4, 5, 2, 70), (2, 2, 20, 4, 6)])
def test_fused_decode_is_attention_over_the_dequantized_layer(xp, rng, method, b, g, window, sinks, prefill):
    """Fused (from coefficients / codes) equals attention over what the layer dequantizes to."""
    opts = dict(residual_window=window, sink_tokens=sinks, decode_path="fused")
    if method == "vq":
        opts.update(codebook_size=8, min_calibration=16)
    cache = make(method, **opts)
    k, v, q = random_kvq(rng, xp, b, H, g, prefill, D)
    cache.prefill(0, k, v, q)
    cfg = arraykv.AttendConfig(D**-0.5, g)
    for _ in range(4):
        k1, v1, q1 = random_kvq(rng, xp, b, H, g, 1, D)
        out = cache.decode(0, k1, v1, q1, cfg)
        assert isinstance(out, arraykv.Fused) and out.output.shape == (b, H * g, 1, D)
        r = cache.dequantize(0)
        want = to_np(arraykv.attention(q1, r.k, r.v, softmax_scale=D**-0.5))
        np.testing.assert_allclose(to_np(out.output), want, rtol=1e-4, atol=2e-5)
    assert cache.is_fitted(0) == (b * prefill >= cache.min_calibration)


def test_energy_rank_differs_for_keys_and_values_and_decode_still_matches(rng):
    """``energy`` picks a rank per side: keys near rank 3, values full-rank noise."""
    basis = rng.standard_normal((H, 3, D))
    k = np.einsum("bhtr,hrd->bhtd", rng.standard_normal((1, H, 120, 3)), basis).astype(np.float32)
    k += 0.01 * rng.standard_normal(k.shape).astype(np.float32)
    v = rng.standard_normal((1, H, 120, D)).astype(np.float32)
    cache = make("lowrank", energy=0.95, rank=None, residual_window=4, sink_tokens=1)
    cache.prefill(0, k, v, k)
    a = cache.layer_arrays(0)
    assert a["k_coef"].shape[-1] == 3 and a["v_coef"].shape[-1] > 20
    cfg = arraykv.AttendConfig(D**-0.5, 2)
    k1, v1, q1 = random_kvq(rng, np, 1, H, 2, 1, D)
    out = cache.decode(0, k1, v1, q1, cfg)
    r = cache.dequantize(0)
    want = arraykv.attention(q1, r.k, r.v, softmax_scale=D**-0.5)
    np.testing.assert_allclose(out.output, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("method", ["lowrank", "vq"])
def test_decode_paths(rng, method):
    k, v, q = random_kvq(rng, np, 1, H, 2, 80, D)
    k1, v1, q1 = random_kvq(rng, np, 1, H, 2, 1, D)
    cfg = arraykv.AttendConfig(D**-0.5, 2)
    outs = {}
    for path in ("auto", "fused", "dequantized"):
        cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, decode_path=path)
        assert cache.get_config()["decode_path"] == path
        cache.prefill(0, k, v, q)
        out = cache.decode(0, k1, v1, q1, cfg)
        outs[path] = to_np(attend(out, q1, D**-0.5))
        if path == "dequantized":
            assert isinstance(out, arraykv.Dequantized)
        elif path == "fused" or method == "lowrank":
            assert isinstance(out, arraykv.Fused)
    for path in ("auto", "fused"):
        np.testing.assert_allclose(outs[path], outs["dequantized"], rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="decode_path"):
        arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, decode_path="fast")


def test_defaults_keep_a_window_and_sinks(rng):
    for method in ("lowrank", "vq"):
        cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D)
        assert cache.residual_window == 20 and cache.sink_tokens == 4
        k, v, q = random_kvq(rng, np, 1, H, 1, 100, D)
        cache.prefill(0, k, v, q)
        a = cache.layer_arrays(0)
        assert a["k_sink"].shape[2] == 4 and a["k_window"].shape[2] == 20
        coded = "k_coef" if method == "lowrank" else "k_codes"
        assert a[coded].shape[2] == 76


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,opts,err",
    [
        ("lowrank", dict(rank=0), ValueError),
        ("lowrank", dict(rank=D + 1), ValueError),
        ("lowrank", dict(rank=4, energy=0.9), ValueError),
        ("lowrank", dict(coeff_dtype="int8"), ValueError),
        ("lowrank", dict(min_calibration=1), ValueError),
        ("lowrank", dict(residual_window=-1), ValueError),
        ("lowrank", dict(calibration="basis"), TypeError),
        ("lowrank", dict(calibration=[None]), ValueError),
        ("lowrank", dict(calibration=KVCacheCompressor(LowRank(rank=2))), ValueError),  # not fitted
        ("lowrank", dict(calibration=KVCacheCompressor(VectorQuantization(codebook_size=4))), TypeError),
        ("vq", dict(codebook_size=1), ValueError),
        ("vq", dict(codebook_size=65537), ValueError),
        ("vq", dict(sub_dim=5), ValueError),
        ("vq", dict(codebook_size=64, min_calibration=32), ValueError),
        ("vq", dict(sink_tokens=-2), ValueError),
    ],
)
def test_bad_options_are_refused(method, opts, err):
    with pytest.raises(err):
        make(method, **opts)


def test_calibration_of_the_wrong_geometry_is_refused(rng):
    x = rng.standard_normal((1, H + 1, 64, D)).astype(np.float32)
    comp = KVCacheCompressor(LowRank(rank=4)).fit(x, x)
    with pytest.raises(ValueError, match="num_kv_heads"):
        make("lowrank", calibration=comp)
    y = rng.standard_normal((1, H, 64, 2 * D)).astype(np.float32)
    pq = KVCacheCompressor(VectorQuantization(codebook_size=4, sub_dim=2)).fit(y, y)
    with pytest.raises(ValueError, match="head_dim"):
        make("vq", calibration=pq)


@pytest.mark.parametrize("method", ["lowrank", "vq"])
def test_a_rejected_decode_changes_nothing(method, rng):
    cache = make(method, residual_window=3)
    k, v, q = random_kvq(rng, np, 1, H, 1, 80, D)
    cache.prefill(0, k, v, q)
    before = snapshot(cache)
    k1, v1, q1 = random_kvq(rng, np, 1, H, 1, 1, D)
    k1[0, 0, 0, 5] = np.nan
    with pytest.raises(ValueError):
        cache.decode(0, k1, v1, q1, arraykv.AttendConfig(D**-0.5))
    assert_same_snapshot(before, snapshot(cache))


def test_vq_fits_a_long_prefill_on_an_even_subsample(rng):
    k, v, q = random_kvq(rng, np, 2, H, 1, 300, D)
    cache = make("vq", codebook_size=4, min_calibration=16, max_calibration=40, seed=1)
    assert cache.get_config()["max_calibration"] == 40
    cache.prefill(0, k, v, q)
    idx = np.round(np.linspace(0, 299, 20)).astype(np.int64)  # 40 vectors per head over batch 2
    comp = KVCacheCompressor(VectorQuantization(codebook_size=4, sub_dim=2, seed=1)).fit(k[:, :, idx], v[:, :, idx])
    np.testing.assert_allclose(
        to_np(cache.layer_arrays(0)["k_centroids"]), comp._fit["k"].centroids, rtol=1e-5, atol=1e-6
    )
    assert cache.layer_arrays(0)["k_codes"].shape[2] == 300  # every token is still encoded
    default = arraykv.make_cache("vq", num_layers=1, num_kv_heads=H, head_dim=D, codebook_size=16)
    assert default.max_calibration == 1024
    with pytest.raises(ValueError, match="max_calibration"):
        make("vq", codebook_size=4, min_calibration=16, max_calibration=8)


@pytest.mark.parametrize(
    "method, head_dim",
    [("lowrank", 16), ("lowrank", 48), ("vq", 16), ("vq", 24), ("pqo4", 24), ("tq3", 24), ("pq2", 48)],
)
def test_a_tokens_codes_do_not_depend_on_the_call_that_brought_it(rng, method, head_dim):
    """The same tokens stored in one call or one by one give the same bits (truncation promises
    the state of a direct build, whatever call a cut falls in): lowrank's projection, vq's
    assignment and the polar codecs with a dense (non-power-of-two) rotation. No window: a token that waits in
    the float16 window is encoded from its float16 copy, one that spills in its own call from
    the input."""
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=head_dim, sink_tokens=2, residual_window=0)
    if method == "vq":
        kw.update(codebook_size=16)
    one, many = arraykv.make_cache(method, **kw), arraykv.make_cache(method, **kw)
    k, v, q = random_kvq(rng, np, 1, 2, 2, 300, head_dim)
    one.prefill(0, k[:, :, :260], v[:, :, :260], q[:, :, :260])  # the calibrating call, shared
    many.prefill(0, k[:, :, :260], v[:, :, :260], q[:, :, :260])
    one.prefill(0, k[:, :, 260:], v[:, :, 260:], q[:, :, 260:])
    for t in range(260, 300):
        many.prefill(0, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
    a, b = one.layer_arrays(0), many.layer_arrays(0)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(to_np(a[name]), to_np(b[name]), err_msg=name)
