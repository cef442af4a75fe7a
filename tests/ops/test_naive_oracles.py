"""Every kernel against its plain-loop definition (:mod:`naive`), kernels on and off.

Each test draws fresh random inputs of a few small shapes, runs the library's public entry
point with the accelerated kernels enabled and disabled, and compares with the loop version
written from the module docstrings.

Tolerances
----------
Codes (bit packing, integer, TurboQuant-MSE, product quantization, outlier positions) must be
equal, except where the loop version, computed in float64, puts a value within ``TIE`` of a
decision boundary that the library evaluates in float32 (a coordinate of ``y = M x/‖x‖`` at a
codebook threshold, two centroids at equal distance, ``|x − μ|`` at ``threshold · σ``): there a
code may land on the other side; at most ``MAX_TIE_FRACTION`` of them. float16 lengths may
differ by one float16 step (the float32 length rounded to the neighbouring half). Values
computed in float32 from the same stored arrays are compared relative to the largest value
(``VALUE_TOL``); fused attention outputs relative to the output scale (``ATTN_TOL``).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

import arraykv
from arraykv import ops
from arraykv.ops import pack_bits, set_kernels_enabled, split_outliers, unpack_bits
from arraykv.quant import intq, polar, vq
from arraykv.quant.codebooks import make_codebook
from arraykv.quant.intq import IntQuantized
from arraykv.quant.rotation import make_rotation
from arraykv.quant.vq import VQCodebook as PQCodebook

from naive import (
    int_decode_attention_loops,
    intq_dequantize_loops,
    intq_quantize_loops,
    lowrank_decode_attention_loops,
    pack_bits_loops,
    polar_decode_attention_loops,
    polar_decode_loops,
    polar_encode_loops,
    polar_rotate_loops,
    pq_assign_loops,
    pq_code_bits,
    pq_decode_attention_loops,
    pq_decode_loops,
    pq_encode_loops,
    split_outliers_loops,
    unpack_bits_loops,
)

# The quantizers with the ops layer's passes: a kernel where one serves the namespace and
# kernels are on, the array-API reference otherwise (what the caches call).
quantize_groups = partial(
    intq.quantize_groups, group_minmax=ops.intq_group_minmax, quantize_pack=ops.intq_quantize_pack
)
dequantize_groups = partial(intq.dequantize_groups, dequantize=ops.intq_dequantize)
polar_encode = partial(polar.polar_encode, encode=ops.polar_encode)
polar_decode = partial(polar.polar_decode, decode=ops.polar_decode)
pq_encode = partial(vq.vq_encode, encode=ops.vq_encode)
pq_decode = partial(vq.vq_decode, decode=ops.vq_decode)

#: Distance to a decision boundary below which a float32 computation may decide either way.
TIE = 1e-6
#: Most codes that may differ, as a fraction, and only at ties.
MAX_TIE_FRACTION = 0.01
#: float32 values from identical stored inputs, relative to the largest value.
VALUE_TOL = 1e-5
#: Fused decode attention (float32 compute over float16/float32 stored arrays), relative to the output scale.
ATTN_TOL = 2e-5

kernels = pytest.mark.parametrize("kernels", [True, False], ids=["kernels_on", "kernels_off"])


def _close(got, want, tol):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    err = float(np.abs(got - want).max(initial=0.0)) / scale
    assert err <= tol, f"relative error {err:.3g} > {tol}"


def _equal_but_ties(got, want, near_tie, what):
    """Codes equal except at ties (``near_tie`` True where the loop version sits at a boundary)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = got != want
    assert not np.any(diff & ~near_tie), f"{what}: {int(np.sum(diff & ~near_tie))} codes differ away from any tie"
    assert np.mean(diff) <= MAX_TIE_FRACTION, f"{what}: {int(np.sum(diff))} codes differ at ties"
    return diff


# -- bit packing ---------------------------------------------------------------------------------------


@kernels
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_bits(kernels, bits, rng):
    """Little-endian bit stream per row; bits above ``bits`` of a code are dropped."""
    for shape in [(13,), (3, 8), (2, 2, 21)]:
        codes = rng.integers(0, 256, shape).astype(np.uint8)
        n = shape[-1]
        packed = rng.integers(0, 256, shape[:-1] + ((n * bits + 7) // 8,)).astype(np.uint8)
        with set_kernels_enabled(kernels):
            got_packed = pack_bits(codes, bits)
            got_codes = unpack_bits(packed, bits, n)
        np.testing.assert_array_equal(got_packed, pack_bits_loops(codes, bits))
        np.testing.assert_array_equal(got_codes, unpack_bits_loops(packed, bits, n))


# -- group-wise integer quantization -------------------------------------------------------------------


@kernels
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size, param_dtype", [(4, "float32"), (5, "float16")])
def test_intq_quantize_dequantize(kernels, bits, group_size, param_dtype, rng):
    for shape in [(2, 3, 13), (1, 8)]:
        x = (rng.standard_normal(shape) * 2.0 + 0.5).astype(np.float32)
        with set_kernels_enabled(kernels):
            q = quantize_groups(x, bits, group_size, param_dtype=param_dtype)
            back = dequantize_groups(q)
        codes, scale, offset = intq_quantize_loops(x, bits, group_size, param_dtype)
        np.testing.assert_array_equal(q.codes, codes)
        np.testing.assert_array_equal(q.scale, scale)
        np.testing.assert_array_equal(q.offset, offset)
        _close(back, intq_dequantize_loops(q.codes, q.scale, q.offset, bits, group_size, shape[-1]), VALUE_TOL)
        # dequantization of arbitrary codes and parameters, not only of a quantizer's output
        rnd = IntQuantized(
            codes=rng.integers(0, 256, q.codes.shape).astype(np.uint8),
            scale=q.scale,
            offset=q.offset,
            bits=bits,
            group_size=group_size,
            n=shape[-1],
        )
        with set_kernels_enabled(kernels):
            back = dequantize_groups(rnd)
        _close(back, intq_dequantize_loops(rnd.codes, rnd.scale, rnd.offset, bits, group_size, shape[-1]), VALUE_TOL)


# -- TurboQuant-MSE ------------------------------------------------------------------------------------


@kernels
@pytest.mark.parametrize("length", ["fit", "unbiased"])
@pytest.mark.parametrize("d, bits, lead", [(8, 1, (5,)), (16, 2, (2, 3)), (12, 3, (4,)), (16, 4, (3,))])
def test_polar_encode_decode(kernels, length, d, bits, lead, rng):
    """Codes, float16 lengths and reconstructions; ``d = 12`` uses the dense orthogonal rotation."""
    x = (rng.standard_normal(lead + (d,)) * 3.0).astype(np.float32)
    flat = x.reshape(-1, d)
    flat[0] = 0.0  # a zero vector: length 0
    flat[-1] = 0.0
    flat[-1, int(rng.integers(d))] = 5.0  # a one-hot spike
    rot = make_rotation(d, int(rng.integers(1000)), like=x)
    cb = make_codebook(bits, d, like=x)
    with set_kernels_enabled(kernels):
        code = polar_encode(x, cb, rot, length=length)
        back = polar_decode(code, cb, rot)
    want_codes, want_len = polar_encode_loops(x, cb, rot, length)
    got_codes = unpack_bits_loops(code.codes, bits, d)
    y, norm = polar_rotate_loops(x, rot)
    thr = np.asarray(cb.thresholds, np.float64)
    # y = 0 of the zero vector sits exactly on the middle threshold: both sides take the lower code, so it must match
    near = (np.min(np.abs(y[..., None] - thr), axis=-1) < TIE) & (norm[..., None] > 0.0)
    diff = _equal_but_ties(got_codes, want_codes, near, "polar codes")
    assert np.all(np.abs(got_codes.astype(int) - want_codes.astype(int))[diff] == 1)
    same_row = ~np.any(diff, axis=-1)
    assert code.norms.dtype == np.float16
    gl, wl = code.norms.astype(np.float64), want_len.astype(np.float64)
    step = np.spacing(np.abs(want_len)).astype(np.float64)
    assert np.all(np.abs(gl - wl)[same_row] <= step[same_row]), "lengths differ by more than one float16 step"
    if not np.any(diff):
        np.testing.assert_array_equal(code.codes, pack_bits_loops(want_codes, bits))
    _close(back, polar_decode_loops(code.codes, code.norms, cb, rot), VALUE_TOL)


# -- product quantization ------------------------------------------------------------------------------


@kernels
@pytest.mark.parametrize("lead, h, t, d, s, K", [((), 2, 5, 8, 2, 4), ((2,), 1, 4, 16, 4, 16), ((), 2, 3, 8, 2, 300)])
def test_pq_encode_decode(kernels, lead, h, t, d, s, K, rng):
    """Nearest centroid per sub-vector, packed (uint16 above 8 bits), and the centroids back."""
    m = d // s
    cent = rng.standard_normal((h, m, K, s)).astype(np.float32)
    cb = PQCodebook(centroids=cent)
    x = rng.standard_normal(lead + (h, t, d)).astype(np.float32)
    bits = pq_code_bits(K)
    with set_kernels_enabled(kernels):
        codes = pq_encode(x, cb)
        back = pq_decode(codes, cb)
    assert codes.bits == bits and codes.subspaces == m
    want_idx, dist = pq_assign_loops(x, cent)
    got_idx = codes.codes.astype(np.int64) if bits > 8 else unpack_bits_loops(codes.codes, bits, m).astype(np.int64)
    # a tie: the two nearest centroids within float32 rounding of ‖x‖² − 2 x·c + ‖c‖²
    two = np.sort(dist, axis=-1)[..., :2]
    xsub = np.asarray(x, np.float64).reshape(lead + (h, t, m, s))
    size = np.sum(xsub**2, axis=-1) + np.max(np.sum(np.asarray(cent, np.float64) ** 2, axis=-1), axis=-1)[:, None, :]
    diff = _equal_but_ties(got_idx, want_idx, two[..., 1] - two[..., 0] <= TIE * size, "pq codes")
    if not np.any(diff):
        np.testing.assert_array_equal(codes.codes, pq_encode_loops(x, cent))
    np.testing.assert_array_equal(np.asarray(back, np.float64), pq_decode_loops(codes.codes, cent, bits))


# -- dense-and-sparse split ----------------------------------------------------------------------------


@kernels
@pytest.mark.parametrize(
    "shape, dtype, threshold",
    [((2, 2, 8, 8), np.float32, 2.5), ((1, 3, 16, 4), np.float16, 3.0), ((2, 1, 5, 16), np.float32, 2.0)],
)
def test_split_outliers(kernels, shape, dtype, threshold, rng):
    x = rng.standard_normal(shape)
    spikes = rng.integers(0, x.size, 6)
    x.reshape(-1)[spikes] *= 25.0
    x = x.astype(dtype)
    with set_kernels_enabled(kernels):
        dense, out = split_outliers(x, threshold)
    want_dense, want_idx, want_val, margin = split_outliers_loops(x, threshold)
    assert want_idx.size > 0
    got_mask = np.zeros(x.size, bool)
    got_mask[np.asarray(out.index, np.int64)] = True
    want_mask = np.zeros(x.size, bool)
    want_mask[want_idx] = True
    scale = float(np.abs(x.astype(np.float64)).max())
    diff = _equal_but_ties(got_mask, want_mask, np.abs(margin.reshape(-1)) <= TIE * scale, "outlier positions")
    idx = np.asarray(out.index, np.int64)
    assert np.all(np.diff(idx) > 0), "index must be ascending"
    assert out.value.dtype == x.dtype
    np.testing.assert_array_equal(out.value, x.reshape(-1)[idx])
    assert dense.dtype == np.float32
    keep = ~(got_mask | want_mask).reshape(shape)  # a position decided differently at a tie holds x or μ
    np.testing.assert_array_equal(np.asarray(dense, np.float64)[keep], x.astype(np.float64)[keep])
    same = (got_mask & want_mask).reshape(shape)
    if not np.any(diff):
        assert np.array_equal(idx, want_idx)
    assert np.all(np.abs(np.asarray(dense, np.float64) - want_dense)[same] <= VALUE_TOL * scale)


# -- fused decode attention through real caches --------------------------------------------------------

SINKS, WINDOW = 2, 6
ROPE = {"theta": 10000.0, "layout": "half"}


def _rope_keys(rng, b, h, n, d, theta=10000.0):
    """Keys ``R_p μ + noise``: a fixed mean per head turned by position ``p`` (rotate-half pairs ``(j, j + d/2)``)."""
    mu = rng.standard_normal((b, h, d)) * 3.0
    half = d // 2
    k = rng.standard_normal((b, h, n, d)) * 0.5
    for p in range(n):
        for j in range(half):
            phi = p * theta ** (-2.0 * j / d)
            c, s = math.cos(phi), math.sin(phi)
            k[:, :, p, j] += mu[:, :, j] * c - mu[:, :, j + half] * s
            k[:, :, p, j + half] += mu[:, :, j + half] * c + mu[:, :, j] * s
    return k


def _fill_and_decode(method, rng, *, b, h, g, d, n, keys="plain", **opts):
    """A one-layer cache after a prefill of ``n - 1`` tokens and a fused decode of the last; (cache, q, output)."""
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, decode_path="fused", **opts)
    if keys == "rope":
        k = _rope_keys(rng, b, h, n, d)
    else:
        spread = np.ones(d)
        spread[rng.choice(d, 2, replace=False)] = 6.0  # large key channels, as real keys have
        k = rng.standard_normal((b, h, n, d)) * spread + rng.standard_normal(d) * 2.0
    v = rng.standard_normal((b, h, n, d)) + 0.5
    qscale = np.exp(rng.standard_normal(d))  # queries loading channels unevenly: non-trivial key weights
    qs = rng.standard_normal((b, h * g, n, d)) * qscale
    k, v, qs = (a.astype(np.float32) for a in (k, v, qs))
    cache.prefill(0, k[:, :, :-1], v[:, :, :-1], qs[:, :, :-1])
    q = qs[:, :, -1:]
    out = cache.decode(0, k[:, :, -1:], v[:, :, -1:], q, arraykv.AttendConfig(d**-0.5, g))
    assert isinstance(out, arraykv.Fused)
    return cache, q, np.asarray(out.output, np.float64)


POLAR_CASES = {
    "pqo2-d8-plain-mean": ("pqo2", dict(b=1, h=1, g=1, d=8), dict(keys="plain", rope=None, outliers=1)),
    "pqo2-d16-rotating-mean-gqa": ("pqo2", dict(b=1, h=2, g=2, d=16), dict(keys="rope", rope=ROPE, outliers=2)),
    "pqo4-d16-rotating-mean-batch": ("pqo4", dict(b=2, h=1, g=2, d=16), dict(keys="rope", rope=ROPE, outliers=1)),
    "tq3-d8-plain-mean": ("tq3", dict(b=1, h=2, g=1, d=8), dict(keys="plain", rope=None, outliers=1)),
    "tq3-d16-rotating-mean-gqa": ("tq3", dict(b=2, h=1, g=2, d=16), dict(keys="rope", rope=ROPE, outliers=2)),
    # head dims with kernel steps of their own (fused_driver.build_steps(dims=...)); lengths past one tile
    "pqo4-d128-rotating-mean-gqa8": (
        "pqo4",
        dict(b=1, h=1, g=8, d=128, n=150),
        dict(keys="rope", rope=ROPE, outliers=2),
    ),
    "pqo2-d64-plain-gqa4": ("pqo2", dict(b=1, h=2, g=4, d=64, n=97), dict(keys="plain", rope=None, outliers=1)),
    "tq3-d64-rotating-mean-gqa3": ("tq3", dict(b=1, h=1, g=3, d=64, n=70), dict(keys="rope", rope=ROPE, outliers=1)),
}


@kernels
@pytest.mark.parametrize("case", list(POLAR_CASES))
def test_polar_fused_decode(kernels, case, rng):
    """Sinks, codes and window; outlier channels, key weights, plain or rotating mean, QJL for ``tq``."""
    method, shape, opts = POLAR_CASES[case]
    opts, shape = dict(opts), dict(shape)
    keys = opts.pop("keys")
    n = shape.pop("n", 45)
    with set_kernels_enabled(kernels):
        cache, q, got = _fill_and_decode(
            method, rng, n=n, keys=keys, sink_tokens=SINKS, residual_window=WINDOW, **shape, **opts
        )
    codec = cache.layer_codec_state(0)
    assert codec.n_sink == SINKS and codec.n_window == SINKS + WINDOW and codec.n_quantized == n - SINKS - WINDOW
    assert codec.k_outlier_idx is not None and codec.k_outlier_idx.shape[-1] == opts["outliers"]
    assert np.any(np.asarray(codec.k_scale) != 1.0), "key weights are all one"
    assert np.any(np.asarray(codec.k_mean) != 0.0), "keys are not centered"
    if keys == "rope":
        assert codec.k_mean_freq is not None, "no rotating key mean"
        assert np.any(np.asarray(codec.k_mean_freq) != 0.0)
    else:
        assert codec.k_mean_freq is None
    assert (codec.qjl is not None) == method.startswith("tq")
    want = polar_decode_attention_loops(codec, q, shape["d"] ** -0.5)
    _close(got, want, ATTN_TOL)


INT_CASES = {
    "int4-d16-gqa-batch": ("int4", dict(b=2, h=2, g=2, d=16), dict(group_size=4)),
    "int2-d8-window": ("int2", dict(b=1, h=1, g=1, d=8), dict(group_size=4, residual_window=8)),
    "int4-d64-gqa3": ("int4", dict(b=1, h=2, g=3, d=64, n=75), dict(group_size=8)),
    "int8-d128-gqa8": ("int8", dict(b=1, h=1, g=8, d=128, n=70), dict(group_size=16)),
}


@kernels
@pytest.mark.parametrize("case", list(INT_CASES))
def test_int_fused_decode(kernels, case, rng):
    method, shape, opts = INT_CASES[case]
    shape = dict(shape)
    n = shape.pop("n", 23)
    with set_kernels_enabled(kernels):
        cache, q, got = _fill_and_decode(method, rng, n=n, **shape, **opts)
    codec = cache.layer_codec_state(0)
    assert codec.n_groups > 0 and codec.n_residual > 0 and codec.v_codes.shape[2] > 0
    if method == "int2":
        assert codec.n_window > 0
    want = int_decode_attention_loops(codec, q, shape["d"] ** -0.5)
    _close(got, want, ATTN_TOL)


def _extras(arrays):
    """The float16 tokens of a lowrank/vq layer: sinks, then the recent window."""
    assert arrays["k_sink"].shape[2] == SINKS and arrays["k_window"].shape[2] > 0
    return (
        np.concatenate([arrays["k_sink"], arrays["k_window"]], axis=2),
        np.concatenate([arrays["v_sink"], arrays["v_window"]], axis=2),
    )


VQ_CASES = {
    "K4-s2-d8": dict(b=1, h=1, g=1, d=8, codebook_size=4, sub_dim=2),
    "K16-s4-d16-gqa-batch": dict(b=2, h=2, g=2, d=16, codebook_size=16, sub_dim=4),
}


@kernels
@pytest.mark.parametrize("case", list(VQ_CASES))
def test_vq_fused_decode(kernels, case, rng):
    opts = dict(VQ_CASES[case])
    shape = {n: opts.pop(n) for n in ("b", "h", "g", "d")}
    with set_kernels_enabled(kernels):
        cache, q, got = _fill_and_decode(
            "vq", rng, n=37, sink_tokens=SINKS, residual_window=WINDOW, max_iter=5, **shape, **opts
        )
    a = cache.layer_arrays(0)
    assert a["k_codes"].shape[2] == 37 - SINKS - WINDOW
    ke, ve = _extras(a)
    b, hq, _, d = q.shape
    want = pq_decode_attention_loops(
        q.reshape(b, hq, d),
        a["k_codes"],
        a["k_centroids"],
        a["v_codes"],
        a["v_centroids"],
        ke,
        ve,
        bits=pq_code_bits(opts["codebook_size"]),
        softmax_scale=d**-0.5,
    )
    _close(got, want.reshape(b, hq, 1, d), ATTN_TOL)


LOWRANK_CASES = {
    "d8-rank4": dict(b=1, h=1, g=1, d=8),
    "d16-rank5-gqa-batch": dict(b=2, h=2, g=2, d=16, rank=5),
}


@kernels
@pytest.mark.parametrize("case", list(LOWRANK_CASES))
def test_lowrank_fused_decode(kernels, case, rng):
    opts = dict(LOWRANK_CASES[case])
    shape = {n: opts.pop(n) for n in ("b", "h", "g", "d")}
    with set_kernels_enabled(kernels):
        cache, q, got = _fill_and_decode(
            "lowrank", rng, n=25, sink_tokens=SINKS, residual_window=WINDOW, **shape, **opts
        )
    a = cache.layer_arrays(0)
    assert a["k_coef"].shape[2] == 25 - SINKS - WINDOW
    ke, ve = _extras(a)
    want = lowrank_decode_attention_loops(
        q,
        a["k_coef"],
        a["k_basis"],
        a["k_mean"],
        a["v_coef"],
        a["v_basis"],
        a["v_mean"],
        ke,
        ve,
        softmax_scale=shape["d"] ** -0.5,
    )
    _close(got, want, ATTN_TOL)
