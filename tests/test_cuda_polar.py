"""GPU PolarQuant kernels against the NumPy implementation (skipped without CuPy and a GPU).

Sanitizer run on a GPU machine:
``compute-sanitizer --tool memcheck python -m pytest -q tests/test_cuda_polar.py -k "64 and 1"``.
"""

import numpy as np
import pytest

import arraykv
from arraykv.backends._cuda_polar import MAX_GROUP, plan_codec_launch, plan_decode_attn
from gpu import requires_gpu


def test_plan_decode_attn_checks_and_geometry():
    p = plan_decode_attn(8, 8, 4, 128, 32768, 4, 4, False, sm_count=132)
    assert p.grid == (p.splits, 8, 8) and p.block == (128,)
    assert p.splits * 8 * 8 >= 132 and 32768 / p.splits >= 64
    assert p.names == ("polar_decode_attn<128, 4, 4, 4, false, 4>",)
    big = plan_decode_attn(1, 2, 12, 64, 10, 3, 2, True)
    assert [c[1] for c in big.chunks] == [MAX_GROUP, 4] and big.splits == 1
    for bad in [dict(head_dim=48), dict(head_dim=512), dict(k_bits=0), dict(v_bits=9), dict(tokens=0), dict(groups=0)]:
        args = dict(batch=1, kv_heads=2, groups=2, head_dim=64, tokens=10, k_bits=4, v_bits=4, qjl=False)
        args.update(bad)
        with pytest.raises(ValueError):
            plan_decode_attn(**args)


def test_plan_codec_launch_checks():
    assert plan_codec_launch("dequantize", 5, 96, 2, False, "float32").name == "polar_dequantize<float, 96, 2, false>"
    with pytest.raises(ValueError, match="power-of-two"):
        plan_codec_launch("quantize", 5, 96, 2, True, "float32")
    with pytest.raises(ValueError, match="multiple of 32"):
        plan_codec_launch("quantize", 5, 40, 2, False, "float32")
    with pytest.raises(ValueError, match="dtype"):
        plan_codec_launch("quantize", 5, 64, 2, True, "float64")


def _pair(method, d, h, g, b, n, seed):
    """The same tokens stored in a NumPy cache and in a CuPy cache."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    spread = np.ones(d)
    spread[:3] = 12.0
    k = (rng.standard_normal((b, h, n, d)) * spread + 1.5).astype(np.float32)
    v = rng.standard_normal((b, h, n, d)).astype(np.float32)
    q = rng.standard_normal((b, h * g, n, d)).astype(np.float32)
    caches = []
    for conv in (np.asarray, cp.asarray):
        c = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d)
        c.prefill(0, conv(k), conv(v), conv(q))
        caches.append(c)
    return caches, rng


@requires_gpu
@pytest.mark.parametrize("method", ["pqo2", "pqo3", "pqo4", "tq3"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_gpu_decode_matches_numpy(method, d, g, b):
    import cupy as cp

    from arraykv.attention.polar_fused import polar_decode_attention_reference
    from arraykv.backends._cuda_polar import polar_decode_attention as gpu_attend

    (cpu, gpu), rng = _pair(method, d, 2, g, b, 300, seed=d * 10 + g + b)
    # codes written by the GPU quantizer equal the CPU ones but for rare ties at a threshold
    a, c = cpu.layer_arrays(0), gpu.layer_arrays(0)
    same = np.mean(a["k_codes"] == cp.asnumpy(c["k_codes"]))
    assert same > 0.999, same
    np.testing.assert_allclose(cp.asnumpy(c["k_norms"]).astype(np.float32), a["k_norms"].astype(np.float32), rtol=2e-3)
    q = rng.standard_normal((b, 2 * g, 1, d)).astype(np.float32)
    codec = gpu.layer_codec_state(0)
    want = polar_decode_attention_reference(codec, cp.asarray(q), d**-0.5)  # array-API path on CuPy
    got = gpu_attend(codec, cp.asarray(q), d**-0.5)
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=1e-4, atol=1e-4 * float(cp.abs(want).max()))
    out = gpu.decode(0, cp.asarray(rng.standard_normal((b, 2, 1, d)), dtype=cp.float32),
                     cp.asarray(rng.standard_normal((b, 2, 1, d)), dtype=cp.float32), cp.asarray(q),
                     arraykv.AttendConfig(d**-0.5, g))
    assert isinstance(out, arraykv.Fused)


@requires_gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_gpu_encode_decode_poisoned(bits, d):
    import cupy as cp

    from arraykv.backends._cuda_polar import polar_decode, polar_encode
    from arraykv.quant.codebooks import make_codebook
    from arraykv.quant.polar import polar_decode_reference, polar_encode_reference
    from arraykv.quant.rotation import make_rotation

    rng = np.random.default_rng(bits + d)
    x = rng.standard_normal((3, 5, d)).astype(np.float32)
    rot_c, cb_c = make_rotation(d, 7, xp=np), make_codebook(bits, d, xp=np)
    rot_g, cb_g = make_rotation(d, 7, xp=cp), make_codebook(bits, d, xp=cp)
    codes, norms = polar_encode(cp.asarray(x), rot_g, cb_g)
    want_codes, want_norms = polar_encode_reference(x, cb_c, rot_c)
    assert np.mean(cp.asnumpy(codes) == want_codes) > 0.999
    np.testing.assert_allclose(cp.asnumpy(norms).astype(np.float32), want_norms.astype(np.float32), rtol=2e-3)
    back = polar_decode(codes, norms, rot_g, cb_g)
    assert bool(cp.all(cp.isfinite(back)))
    np.testing.assert_allclose(cp.asnumpy(back), polar_decode_reference(cp.asnumpy(codes), cp.asnumpy(norms), cb_c, rot_c),
                               rtol=1e-4, atol=1e-5)
