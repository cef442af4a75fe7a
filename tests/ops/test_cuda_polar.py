"""GPU PolarQuant kernels against the array-API and NumPy implementations (skipped without CuPy and a GPU).

Every GPU test draws fresh random inputs (never zeros) and poisons what the kernels write
(outputs and the reused scratch buffers start as NaN or 0xAB), so an element a kernel forgets
to write fails the comparison.

Sanitizer run on a GPU machine (a few cases of each kernel)::

    compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q tests/ops/test_cuda_polar.py \\
        -k "1-4-64-pqo4 or 4-8-128-tq3 or 1-1-256-pq2 or poisoned and 96-3 or window_only"
"""

import dataclasses

import numpy as np
import pytest

import arraykv
from arraykv.ops.cuda.polar import MAX_GROUP, TILE, WARPS, plan_codec_launch, plan_decode_attn

from cache_contract import rotary_embed
from gpu import requires_gpu

MODES = ["pqo2", "pqo3", "pqo4", "pq2", "pq3", "pq4", "tq2", "tq3", "tq4"]
# float16 operands on the tensor cores (queries, centroids, softmax weights x value gains) with
# float32 accumulation: a NumPy emulation of that rounding gives relative errors <= 1.1e-3 on
# these inputs (norm-wise <= 8e-4); a wrong channel, token or head gives errors of order 1.
REL_TOL = 3e-3
MAX_TOL = 5e-3


def test_plan_decode_attn_checks_and_geometry():
    p = plan_decode_attn(8, 8, 4, 128, 32768, 4, 4, False, sm_count=132)
    assert p.grid == (p.splits, 8, 8) and p.block == (WARPS * 32,)
    assert p.name == "polar_decode_attn<128, 4, 4, false, 4, false>"
    assert plan_decode_attn(8, 8, 4, 128, 32768, 4, 4, False, prefetch=True).name.endswith("false, 4, true>")
    # the variant with a logit term per token (a rotating key mean): the template's last argument
    assert plan_decode_attn(8, 8, 4, 128, 32768, 4, 4, False, bias=True).name.endswith("false, 4, false, true>")
    tiles = 32768 // TILE
    assert p.splits * p.tiles_per_split >= tiles > (p.splits - 1) * p.tiles_per_split  # every split holds tiles
    assert 4 * 132 - 64 < p.splits * 8 * 8 <= 4 * 132  # the device filled in one wave (4 blocks per SM)
    p3 = plan_decode_attn(8, 8, 4, 128, 32768, 4, 4, False, sm_count=132, blocks_per_sm=3)
    assert 3 * 132 - 64 < p3.splits * 8 * 8 <= 3 * 132
    small = plan_decode_attn(1, 2, 4, 64, 40, 3, 2, True)  # 3 tiles: one split, 3 of 4 warps busy
    assert small.splits == 1 and small.tiles_per_split == 3 and ", true, 4, " in small.name
    big = plan_decode_attn(1, 2, 12, 64, 10, 3, 2, True)
    assert [c[1] for c in big.chunks] == [MAX_GROUP, 4]
    for bad in [dict(head_dim=48), dict(head_dim=512), dict(k_bits=0), dict(v_bits=9), dict(tokens=0), dict(groups=0)]:
        args = dict(batch=1, kv_heads=2, groups=2, head_dim=64, tokens=10, k_bits=4, v_bits=4, qjl=False)
        args.update(bad)
        with pytest.raises(ValueError):
            plan_decode_attn(**args)


def test_plan_codec_launch_checks():
    assert plan_codec_launch("dequantize", 5, 96, 2, False, "float32").name == "polar_dequantize<float, 96, 2, false>"
    want = "polar_quantize<unsigned short, 64, 3, true>"
    assert plan_codec_launch("quantize", 5, 64, 3, True, "float16").name == want
    with pytest.raises(ValueError, match="power-of-two"):
        plan_codec_launch("quantize", 5, 96, 2, True, "float32")
    with pytest.raises(ValueError, match="multiple of 32"):
        plan_codec_launch("quantize", 5, 40, 2, False, "float32")
    with pytest.raises(ValueError, match="dtype"):
        plan_codec_launch("quantize", 5, 64, 2, True, "float64")


def _data(d, h, g, b, n, seed, rope=False):
    rng = np.random.default_rng(seed)
    spread = np.ones(d)
    spread[rng.choice(d, 3, replace=False)] = 12.0  # a few outlier key channels
    k = (rng.standard_normal((b, h, n, d)) * spread + 1.5).astype(np.float32)
    if rope:  # keys of a rotary model: a large per-head mean, turned by each position
        mu = rng.standard_normal((b, h, 1, d)) * 4.0
        k = rotary_embed(mu + rng.standard_normal((b, h, n, d)) * spread).astype(np.float32)
    v = (rng.standard_normal((b, h, n, d)) + 0.5).astype(np.float32)
    q = rng.standard_normal((b, h * g, n, d)).astype(np.float32)
    return k, v, q, rng


def _pair(method, d, h, g, b, n, seed, rope=False):
    """The same tokens stored in a NumPy cache and in a CuPy cache."""
    import cupy as cp

    k, v, q, rng = _data(d, h, g, b, n, seed, rope)
    caches = []
    for conv in (np.asarray, cp.asarray):
        c = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d)
        c.prefill(0, conv(k), conv(v), conv(q))
        caches.append(c)
    return caches, rng


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an element was not written?)"
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return rel, float(np.abs(got - want).max() / np.abs(want).max())


def _check_close(got, want, what):
    rel, mx = _rel(got, want)
    assert rel < REL_TOL and mx < MAX_TOL, f"{what}: relative error {rel:.2e}, max error {mx:.2e}"


def _poisoned_call(codec, q, scale):
    """Run the GPU kernel twice: the second time with NaN in the output and in every scratch buffer."""
    import cupy as cp

    from arraykv.ops.cuda.polar import polar_decode_attention_into as polar_decode_attention, scratch_buffers

    polar_decode_attention(codec, q, scale)  # allocates the scratch buffers of this shape
    for buf in scratch_buffers():
        buf.fill(np.nan if buf.dtype.kind == "f" else 0xAB)
    out = cp.full(q.shape, cp.nan, dtype=q.dtype)
    res = polar_decode_attention(codec, q, scale, out=out)
    assert res is out
    return out


def _to_gpu_codec(cpu_codec, gpu_codec):
    """The NumPy codec's arrays on the GPU (rotation, codebooks and sketch from the CuPy cache)."""
    import cupy as cp

    fields = {}
    for f in dataclasses.fields(cpu_codec):
        val = getattr(cpu_codec, f.name)
        if isinstance(val, np.ndarray):
            fields[f.name] = cp.asarray(val)
    for name in ("rotation", "k_codebook", "v_codebook", "qjl"):
        fields[name] = getattr(gpu_codec, name)
    fields["k_mean_plan"] = None  # the NumPy cache's plan holds NumPy arrays: the launcher makes its own
    return dataclasses.replace(cpu_codec, **fields)


@requires_gpu
@pytest.mark.parametrize("method", MODES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_gpu_decode_matches_references(method, d, g, b):
    _check_decode(method, d, g, b)


@requires_gpu
@pytest.mark.parametrize("method, d", [("pqo3", 96), ("tq3", 96), ("pq2", 32), ("tq4", 32), ("pqo4", 160)])
def test_gpu_decode_other_head_dims(method, d):
    # 96 and 160: dense rotation; 32, 96, 160 with odd bits: value chunks not byte aligned
    _check_decode(method, d, 4, 2)


@requires_gpu
@pytest.mark.parametrize(
    "method, d, g, b",
    [("pqo4", 128, 4, 2), ("pqo2", 64, 8, 1), ("tq3", 128, 4, 1), ("pq3", 64, 1, 4), ("pqo3", 96, 4, 2)],
)
def test_gpu_decode_rotating_key_mean(method, d, g, b):
    # keys of a rotary model: the caches fit a rotating key mean, whose share of each logit the
    # launcher adds per token (RotaryMeanPlan.logits) to the kernel's logits
    _check_decode(method, d, g, b, rope=True)


def _odd_capacity(codec, extra=5):
    """The codec's token arrays moved into buffers of ``n + extra`` tokens (an odd capacity, so
    rows of later heads start at every alignment) whose spare rows hold 0xFF bytes (NaN as
    float16): a kernel that reads a row past the last token shows it."""
    import cupy as cp

    fields = {}
    for name in ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers", "k_qjl", "k_qjl_norms"):
        a = getattr(codec, name)
        if a is None:
            continue
        b, h, n = a.shape[:3]
        buf = cp.empty((b, h, n + extra) + tuple(a.shape[3:]), dtype=a.dtype)
        buf.view(cp.uint8).fill(0xFF)
        buf[:, :, :n] = a
        fields[name] = buf[:, :, :n]
    return dataclasses.replace(codec, **fields)


@requires_gpu
@pytest.mark.parametrize(
    "method, d, g, b",
    [
        ("pqo4", 128, 4, 3),
        ("tq3", 64, 8, 2),
        ("pq3", 96, 4, 2),
        ("tq2", 256, 2, 2),
        ("pqo2", 128, 1, 1),
        ("pq2", 32, 4, 1),
    ],
)
def test_gpu_decode_odd_capacity(method, d, g, b, monkeypatch):
    # both attention-kernel variants (next-tile prefetch off/on) on codecs whose buffers have an
    # odd capacity (rows of later heads at every alignment) with NaN past the last token,
    # against the array-API reference; 1- and 2-bit codes take the pair tables
    import cupy as cp

    from arraykv.attention.polar_fused import polar_decode_attention_reference
    from arraykv.ops.cuda import polar as cuda_polar

    h = 2
    for n in (203, 37):  # 175 quantized tokens (a partial tile); 9: one partial tile
        (_, gpu), rng = _pair(method, d, h, g, b, n, seed=d * 7 + n)
        codec = _odd_capacity(gpu.layer_codec_state(0))
        q = cp.asarray(rng.standard_normal((b, h * g, 1, d)), dtype=cp.float32)
        assert cuda_polar.unsupported_reason(codec, q) is None
        want = cp.asnumpy(polar_decode_attention_reference(codec, q, d**-0.5))
        for prefetch in (False, True):
            monkeypatch.setattr(cuda_polar, "PREFETCH", prefetch)
            _check_close(cp.asnumpy(_poisoned_call(codec, q, d**-0.5)), want, f"n={n}, prefetch={prefetch}")


def test_rotary_plan_follows_the_codec_namespace():
    # a codec whose arrays were handed over to another library (torch tensors as CuPy views in
    # the bridge) still carries its cache's plan: the launcher makes one in the arrays' namespace
    import array_api_strict as xps

    from arraykv.ops.cuda.polar import _rotary_plan

    k, v, q, _ = _data(64, 2, 2, 1, 120, seed=3, rope=True)
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=64)
    cache.prefill(0, k, v, q)
    codec = cache.layer_codec_state(0)
    assert codec.k_mean_plan is not None and _rotary_plan(codec) is codec.k_mean_plan
    moved = dataclasses.replace(
        codec,
        k_mean=xps.asarray(codec.k_mean.astype(np.float32)),  # no float16 there
        k_mean_freq=xps.asarray(codec.k_mean_freq),
        k_mean_pairs=xps.asarray(codec.k_mean_pairs),
    )
    plan = _rotary_plan(moved)
    assert plan is not codec.k_mean_plan and plan.xp is xps and plan.shared == codec.k_mean_plan.shared


def test_key_mean_term_of_the_launcher_is_the_reference_logits():
    # the launcher's per-token term (plan coefficients times phase rows, here the array-API phase
    # rows in place of the GPU kernel's, NumPy in place of CuPy) against the reference's
    # key_mean_logits, which forms every R_p μ
    from arraykv.attention.polar_fused import key_mean_logits
    from arraykv.ops.cuda.polar import _key_mean_bias, _rotary_plan

    b, h, g, d = 2, 2, 3, 64
    k, v, q, rng = _data(d, h, g, b, 150, seed=4, rope=True)
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=h, head_dim=d)
    cache.prefill(0, k, v, q)
    codec = cache.layer_codec_state(0)
    n = codec.n_quantized
    qd = rng.standard_normal((b, h * g, 1, d)).astype(np.float32)

    def host_phase_rows(freq, start, count, family):
        return _rotary_plan(codec).phase_rows(start, start + count)

    got = _key_mean_bias(np, codec, qd, 0.125, n, None, phase_rows=host_phase_rows)
    want = key_mean_logits(codec, qd.reshape(b, h, g, d), 0.125, 0, n).reshape(b * h * g, n)
    assert got.shape == (b * h * g, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@requires_gpu
def test_gpu_rotary_phase_rows_match_float64():
    import cupy as cp

    from arraykv.ops.cuda.polar import rotary_phase_rows
    from arraykv.quant.rotary_mean import rope_frequencies

    freq = np.asarray(rope_frequencies(128, 10000.0), np.float32)
    freq[-5:] = 0.0  # pairs holding a plain mean
    for start, n in ((0, 1), (7, 300), (131000, 1000)):  # far positions: angles of 10^5 radians
        got = rotary_phase_rows(cp.asarray(freq), start, n).get()
        ang = freq.astype(np.float64)[None, :] * np.arange(start, start + n, dtype=np.float64)[:, None]
        want = np.concatenate([np.cos(ang), np.sin(ang), np.ones((n, 1))], axis=1)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert rotary_phase_rows(cp.asarray(freq), 5, 0).shape == (0, 129)


def _check_decode(method, d, g, b, rope=False):
    import cupy as cp

    from arraykv.attention.polar_fused import polar_decode_attention_reference
    from arraykv.ops.cuda.polar import unsupported_reason

    h, n = 2, 301  # 273 quantized tokens: several splits, warps with different tile counts, a partial tile
    (cpu, gpu), rng = _pair(method, d, h, g, b, n, seed=MODES.index(method) * 10000 + d * 10 + g + b, rope=rope)
    codec = gpu.layer_codec_state(0)
    assert (codec.k_mean_freq is not None) == rope  # random keys: no rotary convention found
    if rope:
        assert codec.k_mean_plan is not None and codec.k_mean_plan.shared
    a, c = cpu.layer_arrays(0), gpu.layer_arrays(0)
    # the caches calibrate (means, channel weights) in their own float arithmetic, so a few
    # coordinates land on the other side of a threshold (more with a fitted rotating mean: 0.9925
    # of the code bytes agreed for pqo3, head_dim 96 on an H200); rows whose codes all agree
    # have the same norm up to float16 rounding
    ca, cc = a["k_codes"], cp.asnumpy(c["k_codes"])
    assert np.mean(ca == cc) > (0.98 if rope else 0.999)
    rows = np.all(ca == cc, axis=-1)
    assert rows.mean() > 0.5
    np.testing.assert_allclose(
        cp.asnumpy(c["k_norms"])[rows].astype(np.float32), a["k_norms"][rows].astype(np.float32), rtol=5e-3
    )
    scale = d**-0.5
    q = rng.standard_normal((b, h * g, 1, d)).astype(np.float32) * 2.0
    qg = cp.asarray(q)
    assert unsupported_reason(codec, qg) is None
    # 1. kernel vs the array-API reference on CuPy, same codec
    got = _poisoned_call(codec, qg, scale)
    want = polar_decode_attention_reference(codec, qg, scale)
    _check_close(cp.asnumpy(got), cp.asnumpy(want), "vs array-API reference on CuPy")
    # 2. kernel vs NumPy on the same data: the NumPy cache's arrays copied to the GPU
    cpu_codec = cpu.layer_codec_state(0)
    got_np = _poisoned_call(_to_gpu_codec(cpu_codec, codec), qg, scale)
    _check_close(cp.asnumpy(got_np), polar_decode_attention_reference(cpu_codec, q, scale), "vs NumPy reference")
    # 3. float16 queries give float16 outputs
    q16 = qg.astype(cp.float16)
    got16 = _poisoned_call(codec, q16, scale)
    assert got16.dtype == cp.float16
    _check_close(
        cp.asnumpy(got16).astype(np.float32),
        cp.asnumpy(polar_decode_attention_reference(codec, q16.astype(cp.float32), scale)),
        "float16 queries",
    )
    # 4. the cache's decode on CuPy arrays is this kernel
    kn = cp.asarray(rng.standard_normal((b, h, 1, d)), dtype=cp.float32)
    vn = cp.asarray(rng.standard_normal((b, h, 1, d)), dtype=cp.float32)
    out = gpu.decode(0, kn, vn, qg, arraykv.AttendConfig(scale, g))
    assert isinstance(out, arraykv.Fused)
    _check_close(
        cp.asnumpy(out.output),
        cp.asnumpy(polar_decode_attention_reference(gpu.layer_codec_state(0), qg, scale)),
        "cache decode",
    )


@requires_gpu
@pytest.mark.parametrize("method", ["pqo4", "tq3"])
def test_gpu_decode_window_only_and_fallback(method):
    import cupy as cp

    from arraykv.attention.polar_fused import polar_decode_attention_reference
    from arraykv.ops.cuda.polar import unsupported_reason

    # fewer tokens than sinks + window: nothing quantized, only the merge with the window runs
    (_, gpu), rng = _pair(method, 64, 2, 4, 2, 20, seed=5)
    codec = gpu.layer_codec_state(0)
    assert codec.n_quantized == 0
    q = cp.asarray(rng.standard_normal((2, 8, 1, 64)), dtype=cp.float32)
    _check_close(
        cp.asnumpy(_poisoned_call(codec, q, 0.125)),
        cp.asnumpy(polar_decode_attention_reference(codec, q, 0.125)),
        "window only",
    )
    # head_dim 512 is beyond the kernel: the launcher falls back to the array-API version
    (_, big), rng = _pair(method, 512, 1, 2, 1, 80, seed=6)
    codec = big.layer_codec_state(0)
    q = cp.asarray(rng.standard_normal((1, 2, 1, 512)), dtype=cp.float32)
    assert unsupported_reason(codec, q) is not None
    from arraykv.ops.cuda.polar import polar_decode_attention

    np.testing.assert_allclose(
        cp.asnumpy(polar_decode_attention(codec, q, 0.05)),
        cp.asnumpy(polar_decode_attention_reference(codec, q, 0.05)),
        rtol=1e-6,
    )


@requires_gpu
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_gpu_encode_decode_poisoned(bits, d, unbiased):
    import cupy as cp

    from arraykv import _compat
    from arraykv.ops.cuda.polar import polar_decode_into, polar_encode_into
    from arraykv.quant.codebooks import make_codebook
    from arraykv.quant.polar import polar_decode_reference, polar_encode_reference
    from arraykv.quant.rotation import make_rotation

    xpc = _compat.namespace(cp.zeros(1))
    rng = np.random.default_rng(bits * 1000 + d)
    x = rng.standard_normal((3, 5, d)).astype(np.float32) * rng.uniform(0.1, 10.0, (3, 5, 1)).astype(np.float32)
    rot_c, cb_c = make_rotation(d, 7, xp=np), make_codebook(bits, d, xp=np)
    rot_g, cb_g = make_rotation(d, 7, xp=xpc), make_codebook(bits, d, xp=xpc)
    want_codes, want_norms = polar_encode_reference(x, cb_c, rot_c)
    for dtype in (cp.float32, cp.float16):
        xg = cp.asarray(x).astype(dtype)
        codes = cp.full(want_codes.shape, 0xAB, dtype=cp.uint8)
        norms = cp.full(want_norms.shape, cp.nan, dtype=cp.float16)
        polar_encode_into(xg, cb_g, rot_g, unbiased=unbiased, codes_out=codes, norms_out=norms)
        ref_codes, ref_norms = polar_encode_reference(cp.asnumpy(xg).astype(np.float32), cb_c, rot_c, unbiased=unbiased)
        assert np.mean(cp.asnumpy(codes) == ref_codes) > 0.99
        np.testing.assert_allclose(cp.asnumpy(norms).astype(np.float32), ref_norms.astype(np.float32), rtol=2e-3)
    back = cp.full((3, 5, d), cp.nan, dtype=cp.float32)
    codes_g = cp.asarray(want_codes)
    polar_decode_into(codes_g, cp.asarray(want_norms), cb_g, rot_g, out=back)
    np.testing.assert_allclose(
        cp.asnumpy(back),
        polar_decode_reference(want_codes, want_norms, cb_c, rot_c),
        rtol=1e-4,
        atol=1e-5 * float(np.abs(x).max()),
    )
