"""Options and scales at the public entry points: refused when meaningless, NumPy scalars accepted.

A softmax scale that is NaN, infinite, zero, negative, a bool or a string is refused by every
public attention function; NumPy scalars are accepted wherever Python numbers and bools are,
and come back as Python ``int``/``float``/``bool`` so that a cache saves them as plain JSON.
"""

import json

import numpy as np
import pytest

import arraykv
from arraykv.attention.int_fused import int_decode_attention_reference
from arraykv.attention.lowrank_fused import lowrank_decode_attention
from arraykv.attention.polar_fused import polar_decode_attention_reference
from arraykv.compressor import Hybrid, LowRank
from arraykv.ops import int_decode_attention, polar_decode_attention
from arraykv.quant.lowrank import LowRankLayerCoefficients
from arraykv.quant.rotary_mean import check_rope

BAD_SCALES = [
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (-float("inf"), ValueError),
    (0.0, ValueError),
    (0, ValueError),
    (-1.0, ValueError),
    (3e38, ValueError),  # every logit would overflow to inf and the softmax give NaN
    (1e5, ValueError),
    (True, TypeError),
    ("0.5", TypeError),
    (None, TypeError),
    (np.float32("nan"), ValueError),
    (np.bool_(True), TypeError),
]


def _qkv(rng, t=5, d=16):
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
    k = rng.standard_normal((1, 2, t, d)).astype(np.float32)
    v = rng.standard_normal((1, 2, t, d)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("scale,exc", BAD_SCALES, ids=[repr(s) for s, _ in BAD_SCALES])
def test_attention_refuses_meaningless_softmax_scales(rng, scale, exc):
    q, k, v = _qkv(rng)
    with pytest.raises(exc, match="softmax_scale"):
        arraykv.attention(q, k, v, softmax_scale=scale)
    with pytest.raises(exc, match="softmax_scale"):
        arraykv.AttendConfig(scale)


@pytest.mark.parametrize("scale,exc", BAD_SCALES, ids=[repr(s) for s, _ in BAD_SCALES])
def test_fused_attention_functions_refuse_meaningless_scales(rng, scale, exc):
    d = 16
    q, k, v = _qkv(rng, t=40, d=d)
    cache = arraykv.make_cache("int4", num_layers=1, num_kv_heads=2, head_dim=d, group_size=8)
    cache.prefill(0, k, v, np.repeat(q, 40, axis=2))
    codec = cache.layer_codec_state(0)
    for fn in (int_decode_attention, int_decode_attention_reference):
        with pytest.raises(exc, match="scale"):
            fn(codec, q, scale)
    polar = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=d)
    polar.prefill(0, k, v, np.repeat(q, 40, axis=2))
    pc = polar.layer_codec_state(0)
    for fn in (polar_decode_attention, polar_decode_attention_reference):
        with pytest.raises(exc, match="scale"):
            fn(pc, q, scale)
    empty = np.zeros((1, 2, 0, 4), np.float32)
    with pytest.raises(exc, match="softmax_scale"):
        no_coded = LowRankLayerCoefficients(empty, None, None, empty, None, None)
        lowrank_decode_attention(q, no_coded, k, v, softmax_scale=scale)
    if scale is not None:  # None is this option's default: 1/sqrt(head_dim)
        with pytest.raises(exc, match="softmax_scale"):
            arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=d, softmax_scale=scale)


def test_numpy_scalar_softmax_scale_gives_the_same_attention(rng):
    q, k, v = _qkv(rng)
    want = arraykv.attention(q, k, v, softmax_scale=0.25)
    got = arraykv.attention(q, k, v, softmax_scale=np.float32(0.25))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32


def test_attend_config_takes_numpy_scalars_as_python_numbers():
    cfg = arraykv.AttendConfig(np.float32(0.125), np.int64(2))
    assert cfg == arraykv.AttendConfig(0.125, 2)
    assert type(cfg.softmax_scale) is float and type(cfg.n_kv_groups) is int
    for bad, exc in ((np.bool_(True), TypeError), (np.int64(0), ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="n_kv_groups"):
            arraykv.AttendConfig(0.125, bad)


@pytest.mark.parametrize(
    "method,opts",
    [
        (
            "pqo4",
            {
                "center": np.bool_(True),
                "outlier_threshold": np.float32(4),
                "softmax_scale": np.float64(0.25),
                "key_scale": np.bool_(True),
                "seed": np.int64(3),
                "outliers": np.int32(2),
                "rope": {"theta": np.float32(10000), "layout": "half"},
                "check_finite": np.bool_(True),
            },
        ),
        ("tq4", {"center": np.bool_(False), "residual_window": np.int64(0)}),
        ("int4", {"group_size": np.int64(16), "max_tokens": np.int32(64)}),
        ("lowrank", {"center": np.bool_(False), "rank": np.int64(4)}),
        ("lowrank", {"energy": np.float32(0.5)}),
    ],
)
def test_numpy_scalar_options_build_and_save_as_plain_json(tmp_path, rng, method, opts):
    d = 16
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=d, **opts)
    cfg = cache.get_config()
    json.dumps(cfg)  # no NumPy scalar is left in the config
    for name, value in opts.items():
        if name != "rope":
            assert type(cfg[name]) in (bool, int, float), (name, type(cfg[name]))
            assert cfg[name] == value
    k = rng.standard_normal((1, 2, 40, d)).astype(np.float32)
    cache.prefill(0, k, k, k)
    cache.save(tmp_path / "c.akv")
    back = arraykv.load(tmp_path / "c.akv")
    assert back.get_config() == cfg
    np.testing.assert_array_equal(back.dequantize(0).k, cache.dequantize(0).k)


def test_numpy_scalars_in_compressor_methods_and_rope():
    h = Hybrid(rank=np.int64(4), quant_bits=np.int64(8), outlier_threshold=np.float32(4), center=np.bool_(True))
    assert (type(h.rank), type(h.quant_bits), type(h.outlier_threshold), type(h.center)) == (int, int, float, bool)
    lr = LowRank(energy=np.float32(0.5), center=np.bool_(False), per_head=np.bool_(True))
    assert (type(lr.energy), type(lr.center), type(lr.per_head)) == (float, bool, bool)
    assert check_rope({"theta": np.float32(500000), "layout": "half"}) == {"theta": 500000.0, "layout": "half"}


@pytest.mark.parametrize(
    "opts,exc,match",
    [
        ({"center": 1}, ValueError, "center"),
        ({"center": 1.0}, ValueError, "center"),
        ({"center": np.int64(1)}, ValueError, "center"),
        ({"outlier_threshold": "4"}, TypeError, "outlier_threshold"),
        ({"outlier_threshold": np.float32("nan")}, ValueError, "outlier_threshold"),
        ({"key_scale": 1}, TypeError, "key_scale"),
        ({"check_finite": np.int64(1)}, TypeError, "check_finite"),
    ],
)
def test_values_that_only_compare_equal_to_a_bool_are_still_refused(opts, exc, match):
    with pytest.raises(exc, match=match):
        arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=1, head_dim=16, **opts)
