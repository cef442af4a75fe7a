"""One decode step of a full polar window in one call (``polar_store_token``): Numba kernel against
the cache's general sequence (bit for bit) and the array-API reference (to rounding)."""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace
from test_polar_tokens import _calib

from arraykv.ops.numba.polar.store import polar_store_token
from arraykv.ops.numba.polar.tokens import polar_encode_tokens
from arraykv.quant.codebooks import make_codebook
from arraykv.quant.polar import polar_decode_reference
from arraykv.quant.polar_encoder import PolarEncoder
from arraykv.quant.polar_store import polar_store_token_reference
from arraykv.quant.qjl import make_sketch
from arraykv.quant.rotation import make_rotation

CAP, WINDOW = 9, 7  # token rows, window buffer rows


def _case(rng, d, bits, n_out, rotating, qjl, b=2, h=3):
    k = (rng.standard_normal((b, h, 1, d)) * 3).astype(np.float32)
    v = rng.standard_normal((b, h, 1, d)).astype(np.float32)
    wk = (rng.standard_normal((b, h, WINDOW, d)) * 3).astype(np.float16)
    wv = rng.standard_normal((b, h, WINDOW, d)).astype(np.float16)
    calib = _calib(rng, b, h, d, n_out, rotating)
    xp = array_namespace(k)
    kb = make_codebook(bits, d, xp=xp)
    vb = make_codebook(5 - bits if bits < 4 else bits, d, xp=xp)
    rot = make_rotation(d, 3, xp=xp)
    sketch = make_sketch(d, 7, rows=64, xp=xp) if qjl else None
    first = PolarEncoder(*calib, kb, vb, rot, True, False, sketch)
    enc = polar_encode_tokens(wk[:, :, :1].astype(np.float32), wv[:, :, :1].astype(np.float32), first, 0)
    rows = {}
    for name, a in enc.items():  # buffers of the encode's names, dtypes and trailing shapes, filled with noise
        shape = a.shape[:2] + (CAP,) + a.shape[3:]
        rows[name] = (
            rng.integers(0, 255, size=shape).astype(a.dtype)
            if a.dtype == np.uint8
            else rng.standard_normal(shape).astype(a.dtype)
        )
    return k, v, wk, wv, calib, kb, vb, rot, sketch, rows


def _copy(rows):
    return {n: a.copy() for n, a in rows.items()}


@pytest.mark.parametrize("d,bits", [(64, 4), (128, 2), (128, 3), (96, 4)])
@pytest.mark.parametrize("n_out", [0, 3])
@pytest.mark.parametrize("rotating", [False, True])
@pytest.mark.parametrize("qjl", [False, True])
def test_kernel_is_the_general_sequence_bit_for_bit(d, bits, n_out, rotating, qjl, rng):
    """Encode of the leaving row, float16 of the new token: what the cache's general path stores."""
    k, v, wk, wv, calib, kb, vb, rot, sketch, rows = _case(rng, d, bits, n_out, rotating, qjl)
    leaving, arriving, at, start = 2, 5, 4, 31000
    got_rows, got_wk, got_wv = _copy(rows), wk.copy(), wv.copy()
    encoder = PolarEncoder(*calib, kb, vb, rot, True, False, sketch)
    assert polar_store_token(k, v, got_wk, got_wv, leaving, arriving, encoder, start, got_rows, at) is True
    enc = polar_encode_tokens(
        wk[:, :, leaving : leaving + 1].astype(np.float32),
        wv[:, :, leaving : leaving + 1].astype(np.float32),
        encoder,
        start,
    )
    assert sorted(enc) == sorted(rows)
    for name, a in rows.items():
        want = a.copy()
        want[:, :, at : at + 1] = enc[name]
        np.testing.assert_array_equal(got_rows[name].view(np.uint8), want.view(np.uint8), err_msg=name)
    want_wk, want_wv = wk.copy(), wv.copy()
    want_wk[:, :, arriving : arriving + 1] = k.astype(np.float16)
    want_wv[:, :, arriving : arriving + 1] = v.astype(np.float16)
    np.testing.assert_array_equal(got_wk.view(np.uint16), want_wk.view(np.uint16))
    np.testing.assert_array_equal(got_wv.view(np.uint16), want_wv.view(np.uint16))


@pytest.mark.parametrize(
    "d,bits,n_out,rotating,qjl", [(64, 4, 3, True, False), (128, 2, 0, False, True), (96, 3, 2, True, True)]
)
def test_kernel_equals_reference(d, bits, n_out, rotating, qjl, rng):
    k, v, wk, wv, calib, kb, vb, rot, sketch, rows = _case(rng, d, bits, n_out, rotating, qjl)
    outs = []
    for fn in (polar_store_token, polar_store_token_reference):
        r, a, b = _copy(rows), wk.copy(), wv.copy()
        assert fn(k, v, a, b, 6, 0, PolarEncoder(*calib, kb, vb, rot, False, True, sketch), 500, r, 8) is True
        outs.append((r, a, b))
    (gr, ga, gb), (wr, wa, wb) = outs
    np.testing.assert_array_equal(ga, wa)  # float16 of the new token: exact in both
    np.testing.assert_array_equal(gb, wb)
    for name in rows:  # everything but row 8 untouched
        np.testing.assert_array_equal(gr[name][:, :, :8], rows[name][:, :, :8])
        np.testing.assert_array_equal(wr[name][:, :, :8], rows[name][:, :, :8])
    for side, book in (("k", kb), ("v", vb)):  # codes may differ where rounding meets a threshold
        a = polar_decode_reference(gr[f"{side}_codes"][:, :, 8], gr[f"{side}_norms"][:, :, 8], book, rot)
        r = polar_decode_reference(wr[f"{side}_codes"][:, :, 8], wr[f"{side}_norms"][:, :, 8], book, rot)
        assert np.max(np.linalg.norm(a - r, axis=-1) / np.linalg.norm(r, axis=-1)) < 0.05
    if n_out:
        np.testing.assert_allclose(
            gr["k_outliers"].astype(np.float32), wr["k_outliers"].astype(np.float32), rtol=2e-3, atol=2e-3
        )
    if qjl:
        np.testing.assert_allclose(
            gr["k_qjl_norms"][:, :, 8].astype(np.float32),
            wr["k_qjl_norms"][:, :, 8].astype(np.float32),
            rtol=0.05,
            atol=1e-3,
        )


@pytest.mark.parametrize("where", ["new key", "new value", "outlier channel", "length"])
@pytest.mark.parametrize("fn", ["kernel", "reference"])
def test_overflowing_float16_result_is_refused(where, fn, rng):
    k, v, wk, wv, calib, kb, vb, rot, sketch, rows = _case(rng, 64, 4, 2, False, True)
    leaving = 1
    if where == "new key":
        k[1, 2, 0, 5] = 7e4
    elif where == "new value":
        v[0, 0, 0, 0] = -1e9
    else:  # a leaving key whose weighted outlier channel, or whose whole length, exceeds 65504
        k_scale = calib[2]
        k_scale[...] = np.float16(60000.0)
        if where == "outlier channel":
            wk[0, 1, leaving, calib[3][0, 1, 0]] = np.float16(30000.0)
        else:
            wk[:, :, leaving] = np.float16(3.0)
    f = polar_store_token if fn == "kernel" else polar_store_token_reference
    r = _copy(rows)
    encoder = PolarEncoder(*calib, kb, vb, rot, True, True, sketch)
    assert f(k, v, wk.copy(), wv.copy(), leaving, 4, encoder, 9, r, 3) is False
    for name in rows:  # whatever was written lies outside the rows a cache holds (index 3 and up)
        np.testing.assert_array_equal(r[name][:, :, :3], rows[name][:, :, :3])
