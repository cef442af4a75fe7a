"""The one-call encode of a polar cache's spilled tokens: Numba kernel against the array-API reference."""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace

from arraykv.ops.numba.polar.tokens import polar_encode_tokens
from arraykv.quant.bitpack import unpack_bits_reference
from arraykv.quant.codebooks import make_codebook
from arraykv.quant.polar import polar_decode_reference
from arraykv.quant.polar_encoder import PolarEncoder
from arraykv.quant.polar_tokens import polar_encode_tokens_reference
from arraykv.quant.qjl import make_sketch
from arraykv.quant.rotary_mean import rope_frequencies, rope_pairs
from arraykv.quant.rotation import make_rotation


def _calib(rng, b, h, d, n_out, rotating):
    k_mean = rng.standard_normal((b, h, d)).astype(np.float16)
    v_mean = rng.standard_normal((b, h, d)).astype(np.float16)
    k_scale = (0.5 + rng.random((b, h, d))).astype(np.float16)
    idx = np.sort(
        np.stack([np.stack([rng.choice(d, n_out, replace=False) for _ in range(h)]) for _ in range(b)]), axis=-1
    ).astype(np.int32)
    freq = pairs = None
    if rotating:
        pairs = np.asarray(rope_pairs(d, "half", xp=np), np.int32)
        f = np.asarray(rope_frequencies(d, 10000.0), np.float32)
        freq = np.broadcast_to(f, (b, h, d // 2)).copy()
        freq[0, 0, :3] = 0.0  # some pairs that do not turn
    return k_mean, v_mean, k_scale, idx, freq, pairs


@pytest.mark.parametrize("d,bits", [(64, 4), (128, 2), (128, 3), (96, 4)])
@pytest.mark.parametrize("n_out", [0, 3])
@pytest.mark.parametrize("rotating", [False, True])
@pytest.mark.parametrize("t", [1, 5, 300])
def test_kernel_equals_reference(d, bits, n_out, rotating, t, rng):
    b, h, start = 2, 3, 40000
    k = (rng.standard_normal((b, h, t, d)) * 3).astype(np.float32)
    v = rng.standard_normal((b, h, t, d)).astype(np.float32)
    calib = _calib(rng, b, h, d, n_out, rotating)
    xp = array_namespace(k)
    kb = make_codebook(bits, d, xp=xp)
    vb = make_codebook(5 - bits if bits < 4 else bits, d, xp=xp)
    rot = make_rotation(d, 3, xp=xp)
    args = (k, v, PolarEncoder(*calib, kb, vb, rot, True, False), start)
    got = polar_encode_tokens(*args)
    want = polar_encode_tokens_reference(*args)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
    if n_out:
        np.testing.assert_allclose(
            got["k_outliers"].astype(np.float32), want["k_outliers"].astype(np.float32), rtol=2e-3, atol=2e-3
        )
    for side, book in (("k", kb), ("v", vb)):
        # codes may differ where rounding puts a coordinate on a threshold: compare decoded vectors
        a = polar_decode_reference(got[f"{side}_codes"], got[f"{side}_norms"], book, rot)
        r = polar_decode_reference(want[f"{side}_codes"], want[f"{side}_norms"], book, rot)
        err = np.linalg.norm(a - r, axis=-1) / np.maximum(np.linalg.norm(r, axis=-1), 1e-6)
        assert np.mean(err) < 2e-3 and np.max(err) < 0.2
        same = np.mean(got[f"{side}_codes"] == want[f"{side}_codes"])
        assert same > 0.98, same


@pytest.mark.parametrize("d,bits,rows", [(64, 2, 64), (128, 3, 100), (96, 1, 96)])
@pytest.mark.parametrize("n_out", [0, 4])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_qjl_sketch_kernel_equals_reference(d, bits, rows, n_out, t, rng):
    """A tq cache's keys: the residual of the stored key code, sketched in the same call."""
    b, h, start = 2, 3, 1000
    k = (rng.standard_normal((b, h, t, d)) * 2).astype(np.float32)
    v = rng.standard_normal((b, h, t, d)).astype(np.float32)
    calib = _calib(rng, b, h, d, n_out, rotating=t != 7)
    xp = array_namespace(k)
    kb, vb = make_codebook(bits, d, xp=xp), make_codebook(bits, d, xp=xp)
    rot = make_rotation(d, 5, xp=xp)
    sketch = make_sketch(d, 11, rows=rows, xp=xp)
    args = (k, v, PolarEncoder(*calib, kb, vb, rot, False, False, sketch), start)
    got = polar_encode_tokens(*args)
    want = polar_encode_tokens_reference(*args)
    assert sorted(got) == sorted(want)
    assert got["k_qjl"].shape == want["k_qjl"].shape == (b, h, t, (rows + 7) // 8)
    assert got["k_qjl"].dtype == np.uint8 and got["k_qjl_norms"].dtype == np.float16
    # the residual is the key minus its reconstruction from the stored codes and float16 length
    resid = _residuals(want, k, calib, start, kb, rot)
    np.testing.assert_allclose(
        want["k_qjl_norms"].astype(np.float32), np.linalg.norm(resid, axis=-1), rtol=2e-3, atol=1e-4
    )
    proj = resid @ np.asarray(sketch.matrix, np.float64).T
    clear = np.abs(proj) > 1e-4 * np.linalg.norm(resid, axis=-1, keepdims=True)  # not within rounding of 0
    stored = unpack_bits_reference(want["k_qjl"], 1, rows).astype(bool)
    np.testing.assert_array_equal(stored[clear], (proj >= 0)[clear])
    # the kernel: same signs except where rounding puts a projection on the other side of 0
    # (or a coordinate of the key code on another side of a threshold, which moves the residual)
    same_code = np.all(got["k_codes"] == want["k_codes"], axis=-1)
    agree = unpack_bits_reference(got["k_qjl"], 1, rows) == unpack_bits_reference(want["k_qjl"], 1, rows)
    assert np.mean(agree[same_code]) > 0.995
    np.testing.assert_allclose(
        got["k_qjl_norms"][same_code].astype(np.float32),
        want["k_qjl_norms"][same_code].astype(np.float32),
        rtol=3e-3,
        atol=1e-4,
    )


def _residuals(enc, k, calib, start, kb, rot):
    """float64 residuals ``k_c − k̂_c`` of encoded keys, written out from the definitions."""
    k_mean, _, k_scale, idx, freq, pairs = calib
    b, h, t, d = k.shape
    mean = np.broadcast_to(k_mean.astype(np.float64)[:, :, None, :], (b, h, t, d)).copy()
    if freq is not None:
        pos = np.arange(start, start + t, dtype=np.float64)
        for j, (a, c) in enumerate(pairs):
            ang = freq[:, :, j, None].astype(np.float64) * pos
            ma, mc = k_mean[:, :, a, None].astype(np.float64), k_mean[:, :, c, None].astype(np.float64)
            mean[:, :, :, a] = ma * np.cos(ang) - mc * np.sin(ang)
            mean[:, :, :, c] = mc * np.cos(ang) + ma * np.sin(ang)
    kc = (k - mean) * k_scale.astype(np.float64)[:, :, None, :]
    decoded = polar_decode_reference(enc["k_codes"], enc["k_norms"], kb, rot).astype(np.float64)
    resid = kc - decoded
    for bi in range(b):  # the outlier channels are stored exactly: no residual
        for hi in range(h):
            resid[bi, hi][:, idx[bi, hi]] = 0.0
    return resid
