import numpy as np
import pytest

import arraykv
from arraykv import CompressedKV, Hybrid, KVCacheCompressor, LowRank, VectorQuantization

from conftest import asarray, to_np


def kv(rng, shape=(2, 3, 96, 32), dtype=np.float32):
    k = rng.standard_normal(shape)
    k[..., 5] *= 8  # an outlier channel, as keys have
    v = rng.standard_normal(shape)
    return k.astype(dtype), v.astype(dtype)


def rel_mse(a, b):
    return float(np.mean((np.asarray(a, np.float64) - b) ** 2) / np.mean(np.asarray(b, np.float64) ** 2))


METHODS = [
    LowRank(rank=8),
    LowRank(energy=0.8),
    VectorQuantization(codebook_size=16, sub_dim=4, max_iter=5),
    Hybrid(rank=16, quant_bits=4),
    Hybrid(rank=16, quant_bits=8, group_size=16),
]


@pytest.mark.parametrize("method", METHODS, ids=repr)
@pytest.mark.parametrize("layout", ["bhsd", "hsd"])
def test_round_trip_layout_dtype_namespace(xp, rng, method, layout):
    k, v = kv(rng)
    if layout == "hsd":
        k, v = k[0], v[0]
    comp = KVCacheCompressor(method)
    ka, va = asarray(xp, k), asarray(xp, v)
    c = (comp.compress_kv if layout == "bhsd" else comp.compress_kv_3d)(ka, va)
    assert isinstance(c, CompressedKV) and c.layout == layout and c.shape == k.shape
    k2, v2 = (comp.decompress_kv if layout == "bhsd" else comp.decompress_kv_3d)(c)
    assert k2.shape == ka.shape and k2.dtype == ka.dtype and type(k2) is type(ka)
    assert rel_mse(to_np(k2), k) < 0.8 and rel_mse(to_np(v2), v) < 0.9
    # nbytes is the sum of the plain arrays it holds; ratios follow from it.
    assert c.nbytes == sum(to_np(a).nbytes for a in c.parts().values())
    assert c.bits_per_value == pytest.approx(8 * c.nbytes / (2 * k.size))
    assert c.compression_ratio == pytest.approx(16 / c.bits_per_value)


def test_full_rank_is_lossless_and_float16_kept(xp, rng):
    k, v = kv(rng, (1, 2, 40, 16))
    comp = KVCacheCompressor(LowRank(rank=16))
    k2, v2 = comp.decompress_kv(comp.compress_kv(asarray(xp, k), asarray(xp, v)))
    np.testing.assert_allclose(to_np(k2), k, atol=1e-4)
    if hasattr(xp, "float16"):
        c = comp.compress_kv(asarray(xp, k.astype(np.float16)), asarray(xp, v.astype(np.float16)))
        assert c.k.parts["coeffs"].dtype == xp.float16
        assert comp.decompress_kv(c)[0].dtype == xp.float16


def test_hybrid_close_to_low_rank_and_outliers_exact(xp, rng):
    k, v = kv(rng, (2, 2, 128, 32))
    k[1, 0, 7, 3] = 55.0
    v[0, 1, 100, 30] = -80.0
    lr = KVCacheCompressor(LowRank(rank=16)).compress_kv(asarray(xp, k), asarray(xp, v))
    hy_comp = KVCacheCompressor(Hybrid(rank=16, quant_bits=8))
    hy = hy_comp.compress_kv(asarray(xp, k), asarray(xp, v))
    k2, v2 = (to_np(a) for a in hy_comp.decompress_kv(hy))
    assert k2[1, 0, 7, 3] == 55.0 and v2[0, 1, 100, 30] == -80.0
    assert hy.k.meta["outliers"] >= 1 and hy.v.meta["outliers"] >= 1
    lr_k = to_np(KVCacheCompressor(LowRank(rank=16)).decompress_kv(lr)[0])
    # INT8 coefficients add little to the projection error; the exact outliers only help.
    assert rel_mse(k2, k) <= rel_mse(lr_k, k) * 1.02
    assert hy.bits_per_value < lr.bits_per_value / 2


def test_int4_hybrid_codes_are_packed(rng):
    k, v = kv(rng, (1, 2, 64, 32))
    c = KVCacheCompressor(Hybrid(rank=8, quant_bits=4, group_size=32)).compress_kv(k, v)
    assert c.k.parts["codes"].shape == (1, 2, 8, 32) and c.k.parts["codes"].dtype == np.uint8
    assert c.k.parts["scale"].shape == (1, 2, 8, 2)


def test_fit_once_then_reuse(rng):
    k, v = kv(rng)
    for method in (LowRank(rank=8), Hybrid(rank=8), VectorQuantization(codebook_size=16, sub_dim=8, max_iter=4)):
        comp = KVCacheCompressor(method).fit(k, v)
        assert comp.fitted
        small_k, small_v = k[:, :, :5], v[:, :, :5]  # fewer tokens than centroids: fine once fitted
        c = comp.compress_kv(small_k, small_v)
        assert c.payload_nbytes < c.nbytes
        assert comp.decompress_kv(c)[0].shape == small_k.shape
        with pytest.raises(ValueError, match="fitted on 3 heads"):
            comp.compress_kv(k[:, :2], v[:, :2])
        comp.reset_fit()
        assert not comp.fitted


def test_quant_bits_resolution():
    assert KVCacheCompressor(Hybrid(8, quant_bits=4)).quant_bits == 4
    assert KVCacheCompressor(LowRank(rank=2)).quant_bits == 8
    assert KVCacheCompressor(Hybrid(8), quant_bits=8).method.rank == 8
    with pytest.raises(ValueError, match="contradicts"):
        KVCacheCompressor(Hybrid(8, quant_bits=8), quant_bits=4)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: LowRank(rank=0), ValueError, "rank"),
        (lambda: LowRank(), ValueError, "exactly one"),
        (lambda: LowRank(energy=0.0), ValueError, "energy"),
        (lambda: VectorQuantization(codebook_size=1), ValueError, "codebook_size"),
        (lambda: VectorQuantization(codebook_size=65537), ValueError, "codebook_size"),
        (lambda: VectorQuantization(sub_dim=0), ValueError, "sub_dim"),
        (lambda: Hybrid(rank=4, quant_bits=3), ValueError, "quant_bits"),
        (lambda: Hybrid(rank=4, outlier_threshold=-1.0), ValueError, "outlier_threshold"),
        (lambda: Hybrid(rank=4, group_size=0), ValueError, "group_size"),
        (lambda: KVCacheCompressor("lowrank"), TypeError, "method"),
        (lambda: KVCacheCompressor(LowRank(rank=2), quant_bits=2), ValueError, "quant_bits"),
    ],
)
def test_bad_options(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_arrays(rng):
    k, v = kv(rng, (1, 2, 20, 16))
    nan = k.copy()
    nan[0, 1, 3, 2] = np.nan
    cases = [
        (KVCacheCompressor(LowRank(rank=17)), (k, v), ValueError, "rank must be <= head_dim=16"),
        (KVCacheCompressor(VectorQuantization(sub_dim=5)), (k, v), ValueError, "sub_dim must divide"),
        (KVCacheCompressor(VectorQuantization(codebook_size=64)), (k, v), ValueError, "codebook_size=64"),
        (KVCacheCompressor(LowRank(rank=2)), (k, v[:, :, :5]), ValueError, "shapes must match"),
        (KVCacheCompressor(LowRank(rank=2)), (k, v.astype(np.float64)), TypeError, "dtype"),
        (KVCacheCompressor(LowRank(rank=2)), (nan, v), ValueError, "non-finite"),
        (KVCacheCompressor(LowRank(rank=2)), (k[0], v[0]), ValueError, "4 dimensions"),
        (KVCacheCompressor(LowRank(rank=2)), (k.astype(np.int32), v.astype(np.int32)), TypeError, "floating"),
        (KVCacheCompressor(LowRank(rank=2)), (k.tolist(), v), TypeError, "array"),
    ]
    for comp, args, exc, match in cases:
        with pytest.raises(exc, match=match):
            comp.compress_kv(*args)
    comp = KVCacheCompressor(LowRank(rank=2))
    with pytest.raises(ValueError, match="3 dimensions"):
        comp.compress_kv_3d(k, v)
    with pytest.raises(ValueError, match="layout 'hsd'"):
        comp.decompress_kv_3d(comp.compress_kv(k, v))
    with pytest.raises(TypeError, match="CompressedKV"):
        comp.decompress_kv(k)
    fitted = KVCacheCompressor(LowRank(rank=2)).fit(k, v)
    before = fitted._fit
    with pytest.raises(ValueError, match="non-finite"):
        fitted.fit(nan, v)
    assert fitted._fit is before  # a rejected fit keeps the old one


def test_exports():
    for name in ("KVCacheCompressor", "LowRank", "VectorQuantization", "Hybrid", "CompressedKV"):
        assert name in arraykv.__all__
