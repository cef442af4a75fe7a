import numpy as np
import pytest

import arraykv
from arraykv.ops import lookup
from arraykv.quant.intq import dequantize_groups, quantize_groups

from cache_contract import attend, random_kvq
from conftest import to_np

H, D = 2, 64


def make(method="int4", **kw):
    opts = dict(num_layers=2, num_kv_heads=H, head_dim=D)
    opts.update(kw)
    return arraykv.make_cache(method, **opts)


def rel_mse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


def per_token_baseline(x, bits, g):
    """KIVI-style per-token quantization of both K and V: groups of g channels."""
    return dequantize_groups(quantize_groups(x, bits, g, param_dtype="float16"))


@pytest.mark.parametrize("method,bits", [("int4", 4), ("int8", 8)])
@pytest.mark.parametrize("outlier_channels", [False, True])
def test_at_least_as_good_as_per_token(rng, method, bits, outlier_channels):
    k = rng.standard_normal((1, H, 512, D)).astype(np.float32)
    if outlier_channels:
        k[..., [2, 40]] *= 15
    v = rng.standard_normal((1, H, 512, D)).astype(np.float32)
    cache = make(method)
    q = rng.standard_normal((1, H, 512, D)).astype(np.float32)
    r = cache.prefill(0, k, v, q)
    ours_k, ours_v = rel_mse(r.k, k), rel_mse(r.v, v)
    base_k, base_v = rel_mse(per_token_baseline(k, bits, 32), k), rel_mse(per_token_baseline(v, bits, 32), v)
    assert ours_v == pytest.approx(base_v, rel=1e-6)  # values: the same per-token scheme
    assert ours_k <= base_k * 1.02
    if outlier_channels:
        # Per-channel keys isolate the outlier channels: the other channels keep their precision.
        normal = [c for c in range(D) if c not in (2, 40)]
        rk, base = np.asarray(r.k)[..., normal], np.asarray(per_token_baseline(k, bits, 32))[..., normal]
        assert rel_mse(rk, k[..., normal]) < rel_mse(base, k[..., normal]) / 5
        assert ours_k < base_k / 1.5
    assert ours_k < (0.02 if bits == 4 else 1e-4) * (1 if not outlier_channels else 3)


def test_residual_then_groups_and_tokens_in_order(xp, rng):
    cache = make("int8", group_size=8)
    ks = []
    cfg = arraykv.AttendConfig(D**-0.5, 2)
    for t in (5, 1, 1, 1, 10, 1):
        k, v, q = random_kvq(rng, xp, 2, H, 2, t, D)
        ks.append(to_np(k))
        if t == 1:
            out = cache.decode(0, k, v, q, cfg)
            # NumPy attends from the codes (Numba kernel); other namespaces get K/V back
            fused = lookup("int_decode_attention", xp) is not None
            assert isinstance(out, arraykv.Fused if fused else arraykv.Dequantized)
        else:
            cache.prefill(0, k, v, q)
    want = np.concatenate(ks, axis=2)
    arrays = cache.layer_arrays(0)
    assert arrays["k_codes"].shape == (2, H, 2, D, 8) and arrays["k_residual"].shape == (2, H, 3, D)
    assert arrays["v_codes"].shape == (2, H, 19, D)
    got = to_np(cache.dequantize(0).k)
    np.testing.assert_array_equal(got[:, :, 16:], want[:, :, 16:])  # residual exact
    assert rel_mse(got, want) < 1e-4


def test_int4_packing_and_memory(rng):
    cache = make("int4")
    k, v, q = random_kvq(rng, np, 1, H, 1, 100, D)
    cache.prefill(0, k, v, q)
    a = cache.layer_arrays(0)
    assert a["k_codes"].shape == (1, H, 3, D, 16) and a["k_codes"].dtype == np.uint8
    assert a["v_codes"].shape == (1, H, 100, 32) and a["k_scale"].dtype == np.float16
    held = sum(x.nbytes for x in a.values())
    assert cache.memory_usage() == held
    # 96 quantized key tokens and 100 value tokens at 4 + 32/32 bits, 4 float32 residual keys
    # (and the rollback copies: the 32 float32 keys of the last group, the 8-byte record)
    assert (
        held
        == (96 + 100) * H * D * 5 // 8 + 4 * H * D * 4 + 32 * H * D * 4 + 8
        == (96 + 100) * H * D * 5 // 8 + 4 * H * D * 4 + cache.rollback_bytes()
    )


def test_config_round_trip_and_options():
    cache = make("int8", group_size=16, scale_dtype="float32")
    cfg = cache.get_config()
    assert cfg["method"] == "int8" and cfg["group_size"] == 16
    again = arraykv.make_cache(**cfg)
    assert type(again) is type(cache) and again.get_config() == cfg
    with pytest.raises(ValueError, match="scale_dtype"):
        make("int4", scale_dtype="int8")
    with pytest.raises(ValueError, match="group_size"):
        make("int4", group_size=0)
    with pytest.raises(TypeError, match="does not take"):
        make("int4", bits=3)


def test_restore_layer_is_exact(rng):
    cache = make("int4", group_size=8)
    k, v, q = random_kvq(rng, np, 1, H, 1, 21, D)
    cache.prefill(1, k, v, q)
    st = cache._states[1]
    arrays = cache.layer_arrays(1)
    back = cache._restore_layer(st.xp, st.device, st.batch, st.dtype, st.length, arrays)
    r1, r2 = cache._dequantize(st), cache._dequantize(back)
    np.testing.assert_array_equal(r1.k, r2.k)
    np.testing.assert_array_equal(r1.v, r2.v)
    assert cache._layer_nbytes(back) == cache._layer_nbytes(st)


def test_attention_close_to_exact(rng):
    cache = make("int8")
    k, v, q = random_kvq(rng, np, 1, H, 2, 200, D)
    cache.prefill(0, k, v, q)
    k1, v1, q1 = random_kvq(rng, np, 1, H, 2, 1, D)
    scale = D**-0.5
    got = attend(cache.decode(0, k1, v1, q1, arraykv.AttendConfig(scale, 2)), q1, scale)
    want = arraykv.attention(q1, np.concatenate([k, k1], 2), np.concatenate([v, v1], 2), softmax_scale=scale)
    assert rel_mse(got, want) < 1e-3


# -- int2: KIVI-2 with a float16 residual ---------------------------------------------------


def test_int2_layout_schedule_and_memory(rng):
    """Keys gather in float16 until 32 are held, then become one 2-bit group; the last 32 values slide."""
    cache = make("int2")
    assert cache.residual_window == 32 and cache.get_config()["residual_window"] == 32
    k, v, q = random_kvq(rng, np, 1, H, 1, 45, D)
    cache.prefill(0, k, v, q)
    cfg = arraykv.AttendConfig(D**-0.5, 1)
    ks, vs = [k], [v]
    for n in range(46, 46 + 40):
        k1, v1, q1 = random_kvq(rng, np, 1, H, 1, 1, D)
        ks.append(k1)
        vs.append(v1)
        assert isinstance(cache.decode(0, k1, v1, q1, cfg), arraykv.Fused)
        a = cache.layer_arrays(0)
        assert a["k_codes"].shape == (1, H, n // 32, D, 8) and a["k_residual"].shape == (1, H, n % 32, D)
        assert a["v_codes"].shape == (1, H, n - 32, D // 4) and a["v_window"].shape == (1, H, 32, D)
        assert a["k_residual"].dtype == a["v_window"].dtype == np.float16
        assert cache.stable_length(0) == min(32 * (n // 32), n - 32)
        assert cache.used_bytes() + cache.rollback_bytes() == sum(x.nbytes for x in a.values())
    n = 85
    # 64 quantized keys and 53 quantized values at 2 + 32/32 bits; 21 keys and 32 values in float16
    # (and, in memory_usage only, the rollback copies: the 32 keys of the last chunk, the last 16
    # values, the 8-byte record)
    assert cache.used_bytes() == (64 + 53) * H * D * 3 // 8 + (21 + 32) * H * D * 2
    assert cache.rollback_bytes() == (32 + 16) * H * D * 2 + 8
    k, v = np.concatenate(ks, 2), np.concatenate(vs, 2)
    r = cache.dequantize(0)
    assert r.k.dtype == np.float32 and r.k.shape == (1, H, n, D)
    np.testing.assert_array_equal(r.k[:, :, 64:], k[:, :, 64:].astype(np.float16))  # the key residual
    np.testing.assert_array_equal(r.v[:, :, n - 32 :], v[:, :, n - 32 :].astype(np.float16))  # the value window
    assert rel_mse(r.k[:, :, :64], k[:, :, :64]) < 0.25 and rel_mse(r.v[:, :, :53], v[:, :, :53]) < 0.25


def test_int2_what_is_stored_does_not_depend_on_the_calls(rng):
    """One prefill, pieces, or one token at a time: the same bytes (append and prefill alike)."""
    k, v, q = random_kvq(rng, np, 2, H, 2, 77, D)
    whole, pieces, tokens = make("int2"), make("int2"), make("int2")
    whole.prefill(0, k, v, q)
    for a, b in ((0, 30), (30, 31), (31, 64), (64, 77)):
        pieces.append(0, k[:, :, a:b], v[:, :, a:b], q[:, :, a:b])
    cfg = arraykv.AttendConfig(D**-0.5, 2)
    for t in range(77):
        tokens.decode(0, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1], cfg)
    for other in (pieces, tokens):
        a, b = whole.layer_arrays(0), other.layer_arrays(0)
        assert a.keys() == b.keys()
        for name in set(a) - {"fixed_end"}:  # (the end of the first call, which a truncation may not cut)
            np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize("window", [0, 64, 128])
def test_residual_window_option(rng, window):
    """Chunks of several groups, and no window at all (values quantized on arrival, like int4)."""
    cache = make("int2", residual_window=window)
    k, v, q = random_kvq(rng, np, 1, H, 1, 300, D)
    r = cache.prefill(0, k, v, q)
    a = cache.layer_arrays(0)
    chunk = window or 32
    assert a["k_codes"].shape[2] == 300 // chunk * chunk // 32 and a["k_residual"].shape[2] == 300 % chunk
    assert a["v_codes"].shape[2] == 300 - window
    assert ("v_window" in a) == bool(window)
    assert a["k_residual"].dtype == (np.float16 if window else np.float32)
    assert cache.stable_length(0) == min(300 // chunk * chunk, 300 - window)
    again = arraykv.make_cache(**cache.get_config())
    again.prefill(0, k, v, q)
    np.testing.assert_array_equal(again.dequantize(0).k, r.k)


def test_int4_with_a_window_and_int2_options_are_checked(rng):
    cache = make("int4", residual_window=32, group_size=16)
    k, v, q = random_kvq(rng, np, 1, H, 1, 40, D)
    r = cache.prefill(0, k, v, q)
    np.testing.assert_array_equal(r.v[:, :, 8:], v[:, :, 8:].astype(np.float16))
    assert cache.layer_arrays(0)["k_codes"].shape == (1, H, 2, D, 8)
    with pytest.raises(ValueError, match="residual_window must be 0 or a multiple of group_size=32"):
        make("int2", residual_window=20)
    with pytest.raises(ValueError, match="residual_window"):
        make("int2", residual_window=-32)
    with pytest.raises(ValueError, match="residual_window"):
        make("int2", group_size=7)  # the default window of 32 is not a multiple of 7
    assert make("int2", group_size=16).residual_window == 32
    assert make("int4").residual_window == 0 and make("int8").residual_window == 0


@pytest.mark.parametrize("outlier_channels", [False, True])
def test_int2_per_channel_keys_beat_per_token(rng, outlier_channels):
    """Without the window (to compare like with like), keys per channel vs per token at 2 bits."""
    k = rng.standard_normal((1, H, 512, D)).astype(np.float32)
    if outlier_channels:
        k[..., [2, 40]] *= 15
    v = rng.standard_normal((1, H, 512, D)).astype(np.float32)
    cache = make("int2", residual_window=0)
    r = cache.prefill(0, k, v, rng.standard_normal((1, H, 512, D)).astype(np.float32))
    ours_k, base_k = rel_mse(r.k, k), rel_mse(per_token_baseline(k, 2, 32), k)
    assert rel_mse(r.v, v) == pytest.approx(rel_mse(per_token_baseline(v, 2, 32), v), rel=1e-6)
    assert ours_k <= base_k * 1.02
    if outlier_channels:
        assert ours_k < base_k / 1.5
    assert ours_k < 0.17  # 0.155 measured: per-channel scales absorb the outlier channels


def test_int2_window_in_every_namespace(xp, rng):
    """float16 residual where the namespace has it (float32 otherwise); K/V come back in the input dtype."""
    cache = make("int2")
    k, v, q = random_kvq(rng, xp, 1, H, 1, 50, D)
    r = cache.prefill(0, k, v, q)
    assert r.k.dtype == xp.float32 and tuple(r.v.shape) == (1, H, 50, D)
    a = cache.layer_arrays(0)
    assert a["v_window"].dtype == getattr(xp, "float16", xp.float32)
    np.testing.assert_array_equal(to_np(r.v)[:, :, 18:], to_np(v)[:, :, 18:].astype(to_np(a["v_window"]).dtype))
