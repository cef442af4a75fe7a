"""The 16-lane tile helpers of the fused CPU kernels (``arraykv.ops.numba.ir_tiles``, ``ir_codes``,
``ir_softmax``, ``simd_lanes``) against plain NumPy.

Each helper is checked on fresh random inputs of several shapes: every query-head count that
exercises another block split (blocks of four, then 1-3), head dims 64/128/256, tiles cut
short, code rows that are not contiguous with each other. The instruction paths exist only
with AVX-512 (``HAVE_PERMPS``); the loop references run everywhere.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

import arraykv
from arraykv.attention.polar_fused import polar_decode_attention_reference
from arraykv.ops import polar_decode_attention
from arraykv.ops.numba import cpu_features, ir_codes, ir_softmax, ir_tiles, planar, simd_lanes
from arraykv.ops.numba.fused_driver import softmax_tile

PERMPS = pytest.mark.skipif(
    not cpu_features.HAVE_PERMPS, reason="no AVX-512 on this CPU (the loop references are tested)"
)


def _planar_values(codes, cent, bits):
    """NumPy: centroid values of each code row in planar order (``planar`` module notes)."""
    per = 8 // bits
    planes = [(codes.astype(np.int64) >> (bits * p)) & ((1 << bits) - 1) for p in range(per)]
    return cent[np.concatenate(planes, axis=1)]


@nb.njit
def _unpack4(codes, t0, nt, tab, out):
    ir_codes.unpack_tile_4(codes, t0, nt, tab, out)


@nb.njit
def _unpack2(codes, t0, nt, tab, out):
    ir_codes.unpack_tile_2(codes, t0, nt, tab, out)


@nb.njit
def _scores(buf, nt, qr, s):
    ir_tiles.tile_scores(buf, nt, qr, s)


@nb.njit
def _values(buf, nt, w, acc):
    ir_tiles.tile_values(buf, nt, w, acc)


@nb.njit
def _scores_codes4(codes, t0, nt, tab, qr, s):
    ir_codes.tile_scores_codes_4(codes, t0, nt, tab, qr, s)


@nb.njit
def _scores_codes2(codes, t0, nt, tab, qr, s):
    ir_codes.tile_scores_codes_2(codes, t0, nt, tab, qr, s)


@nb.njit
def _values_codes4(codes, t0, nt, tab, w, acc):
    ir_codes.tile_values_codes_4(codes, t0, nt, tab, w, acc)


@nb.njit
def _values_codes2(codes, t0, nt, tab, w, acc):
    ir_codes.tile_values_codes_2(codes, t0, nt, tab, w, acc)


FUNCS = {
    4: dict(
        unpack=(_unpack4, ir_codes.unpack_tile_4_loop),
        scores=(_scores_codes4, ir_codes.tile_scores_codes_4_loop),
        values=(_values_codes4, ir_codes.tile_values_codes_4_loop),
    ),
    2: dict(
        unpack=(_unpack2, ir_codes.unpack_tile_2_loop),
        scores=(_scores_codes2, ir_codes.tile_scores_codes_2_loop),
        values=(_values_codes2, ir_codes.tile_values_codes_2_loop),
    ),
}


def _codes(rng, n, d, bits):
    """``n`` random code rows of ``d`` codes, each row followed by 8 bytes of other data (strided rows)."""
    nbytes = d * bits // 8
    return rng.integers(0, 256, (n, nbytes + 8), dtype=np.uint8)[:, :nbytes]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("impl", [0, 1], ids=["instructions", "loop"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("nt", [64, 61, 1, 0])
def test_unpack_tile_is_planar_centroids(bits, impl, d, nt, rng):
    if impl == 0 and not cpu_features.HAVE_PERMPS:
        pytest.skip("no AVX-512")
    codes = _codes(rng, 150, d, bits)
    cent = rng.standard_normal(1 << bits).astype(np.float32)
    out = np.full((64, d), 7.0, np.float32)
    FUNCS[bits]["unpack"][impl](codes, 40, nt, planar.table16(cent), out)
    np.testing.assert_array_equal(out[:nt], _planar_values(codes[40 : 40 + nt], cent, bits))
    assert (out[nt:] == 7.0).all()


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("impl", [0, 1], ids=["instructions", "loop"])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("nt", [64, 37, 3])
def test_scores_and_values_from_codes(bits, impl, g, d, nt, rng):
    if impl == 0 and not cpu_features.HAVE_PERMPS:
        pytest.skip("no AVX-512")
    codes = _codes(rng, 200, d, bits)
    cent = rng.standard_normal(1 << bits).astype(np.float32)
    vals = _planar_values(codes[17 : 17 + nt], cent, bits).astype(np.float64)
    qr = rng.standard_normal((g, d)).astype(np.float32)
    s = np.full((g, 64), 7.0, np.float32)
    FUNCS[bits]["scores"][impl](codes, 17, nt, planar.table16(cent), qr, s)
    np.testing.assert_allclose(s[:, :nt], qr @ vals.T, rtol=0, atol=2e-5 * d)
    assert (s[:, nt:] == 7.0).all()
    w = rng.random((g, 64)).astype(np.float32)
    acc = rng.standard_normal((g, d)).astype(np.float32)
    want = acc + w[:, :nt] @ vals
    FUNCS[bits]["values"][impl](codes, 17, nt, planar.table16(cent), w, acc)
    np.testing.assert_allclose(acc, want, rtol=0, atol=2e-5 * nt + 1e-6)


@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nt", [64, 13])
def test_scores_and_values_of_a_buffer(g, d, nt, rng):
    buf = rng.standard_normal((64, d)).astype(np.float32)
    qr = rng.standard_normal((g, d)).astype(np.float32)
    s = np.full((g, 64), 7.0, np.float32)
    _scores(buf, nt, qr, s)
    np.testing.assert_allclose(s[:, :nt], qr.astype(np.float64) @ buf[:nt].T, rtol=0, atol=1e-4)
    assert (s[:, nt:] == 7.0).all()
    w = rng.standard_normal((g, 64)).astype(np.float32)
    acc = rng.standard_normal((g, d)).astype(np.float32)
    want = acc + w[:, :nt].astype(np.float64) @ buf[:nt]
    _values(buf, nt, w, acc)
    np.testing.assert_allclose(acc, want, rtol=0, atol=1e-4)


def test_planar_order_round_trip(rng):
    x = rng.standard_normal((3, 128)).astype(np.float32)
    for per in (2, 4):
        y = planar.to_planar(x, per)
        assert y[0, 1] == x[0, per] and y[0, 128 // per] == x[0, 1]
        np.testing.assert_array_equal(planar.from_planar(y, per), x)


@pytest.mark.parametrize("method", ["pqo4", "pqo2", "pqo3", "tq4"])
@pytest.mark.parametrize("g", [2, 3, 5, 6, 7])
def test_fused_kernel_with_every_group_split(method, g, rng):
    """The kernel's scores/values paths for query-head counts the main tests skip (blocks of 1-3 left over)."""
    h, d, n = 2, 128, 150
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, residual_window=8)
    k = rng.standard_normal((1, h, n, d)).astype(np.float32) + 1.0
    v = rng.standard_normal((1, h, n, d)).astype(np.float32)
    cache.prefill(0, k, v, rng.standard_normal((1, h * g, n, d)).astype(np.float32))
    codec = cache.layer_codec_state(0)
    q = rng.standard_normal((1, h * g, 1, d)).astype(np.float32)
    want = np.asarray(polar_decode_attention_reference(codec, q, d**-0.5), np.float64)
    got = np.asarray(polar_decode_attention(codec, q, d**-0.5), np.float64)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_table16_refuses_big_codebooks():
    with pytest.raises(ValueError, match="at most 16"):
        planar.table16(np.zeros(17, np.float32))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 12, 16])
def test_table16_repeats_codebooks_that_divide_it(size):
    cent = np.arange(1, size + 1, dtype=np.float32)
    tab = planar.table16(cent)
    assert tab.dtype == np.float32 and tab.shape == (16,)
    np.testing.assert_array_equal(tab[:size], cent)  # every code's own entry
    if 16 % size == 0:
        np.testing.assert_array_equal(tab, cent[np.arange(16) % size])  # bits above the code: don't-care
    else:
        assert (tab[size:] == 0).all()


@nb.njit
def _softmax_vec(s, nt, m, l, acc):
    ir_softmax.softmax_rows(s, nt, m, l, acc)


@nb.njit
def _softmax_ref(s, nt, m, l, acc):
    ebits = np.empty(s.shape[1], np.int32)
    for g in range(s.shape[0]):
        softmax_tile(s[g], nt, m, l, acc, g, ebits)


@pytest.mark.parametrize("g", [1, 3, 4, 9])
@pytest.mark.parametrize("nt", [64, 61, 17, 1])
@pytest.mark.parametrize("first", [True, False], ids=["first-tile", "running"])
def test_softmax_rows_equals_the_loop(g, nt, first, rng):
    s = (rng.standard_normal((g, 64)) * 5).astype(np.float32)
    m = np.full(g, -np.inf, np.float32) if first else (rng.standard_normal(g) * 3).astype(np.float32)
    l = np.zeros(g, np.float32) if first else rng.random(g).astype(np.float32)
    acc = rng.standard_normal((g, 128)).astype(np.float32)
    got = [x.copy() for x in (s, m, l, acc)]
    want = [x.copy() for x in (s, m, l, acc)]
    _softmax_vec(got[0], nt, *got[1:])
    _softmax_ref(want[0], nt, *want[1:])
    np.testing.assert_allclose(got[0][:, :nt], want[0][:, :nt], rtol=1e-5, atol=0)
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=0)
    assert (got[0][:, nt : (nt + 15) // 16 * 16] == 0).all()


@nb.njit
def _softmax_affine_vec(s, nt, kn, cq, rt, vn, m, l, acc):
    ir_softmax.softmax_rows_affine(s, nt, kn, cq, rt, vn, m, l, acc)


@pytest.mark.parametrize("g", [1, 4, 9])
@pytest.mark.parametrize("nt", [64, 61, 17, 1])
@pytest.mark.parametrize("first", [True, False], ids=["first-tile", "running"])
def test_softmax_rows_affine_equals_the_loop(g, nt, first, rng):
    s = (rng.standard_normal((g, 64)) * 5).astype(np.float32)
    kn = rng.uniform(0.5, 2.0, 64).astype(np.float32)
    vn = rng.uniform(0.5, 2.0, 64).astype(np.float32)
    kn[nt:], vn[nt:] = np.inf, np.nan  # lanes after the tile's tokens: never used, never written
    cq = rng.standard_normal(g).astype(np.float32)
    rt = rng.standard_normal((g, 64)).astype(np.float32)
    m = np.full(g, -np.inf, np.float32) if first else (rng.standard_normal(g) * 3).astype(np.float32)
    l = np.zeros(g, np.float32) if first else rng.random(g).astype(np.float32)
    acc = rng.standard_normal((g, 128)).astype(np.float32)
    got = [x.copy() for x in (s, m, l, acc)]
    want = [x.copy() for x in (s, m, l, acc)]
    _softmax_affine_vec(got[0], nt, kn, cq, rt, vn, *got[1:])
    ir_softmax.softmax_rows_affine_loop(want[0], nt, kn, cq, rt, vn, *want[1:])
    np.testing.assert_allclose(got[0][:, :nt], want[0][:, :nt], rtol=2e-5, atol=0)
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=0)
    assert (got[0][:, nt : (nt + 15) // 16 * 16] == 0).all()


@nb.njit
def _int4_group(codes, qf, s, off):
    ir_codes.int4_group_scores(codes, qf, s, off)


@nb.njit
def _int8_group(codes, qf, s, off):
    ir_codes.int8_group_scores(codes, qf, s, off)


@nb.njit
def _values4_scaled(codes, t0, nt, tab, w, cscale, acc):
    ir_codes.tile_values_codes_4_scaled(codes, t0, nt, tab, w, cscale, acc)


@nb.njit
def _values8_scaled(codes, t0, nt, tab, w, cscale, acc):
    ir_codes.tile_values_codes_8_scaled(codes, t0, nt, tab, w, cscale, acc)


def _int_codes(rng, rows, bits, n):
    """``rows`` rows of ``n`` random int codes packed as the int caches hold them (strided rows),
    and the codes as floats (n, in order)."""
    nbytes = n * bits // 8
    codes = rng.integers(0, 256, (rows, nbytes + 8), dtype=np.uint8)[:, :nbytes]
    if bits == 8:
        return codes, codes.astype(np.float64)
    return codes, np.stack([codes & 15, codes >> 4], axis=-1).reshape(rows, n).astype(np.float64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("d", [64, 128])
def test_int_group_scores(bits, group, g, d, rng):
    codes, tokens = _int_codes(rng, d, bits, group)  # (channel, token)
    qf = rng.standard_normal((g, d)).astype(np.float32)
    s = np.full((g, group + 40), 7.0, np.float32)
    (_int4_group if bits == 4 else _int8_group)(codes, qf, s, 5)
    np.testing.assert_allclose(s[:, 5 : 5 + group], qf @ tokens, rtol=0, atol=1e-5 * ((1 << bits) - 1) * d)
    assert (s[:, :5] == 7.0).all() and (s[:, 5 + group :] == 7.0).all()


#: (kernel, loop reference, values of the codes in the kernel's order, rtol, atol per token)
SCALED = {
    4: (
        _values4_scaled,
        ir_codes.tile_values_codes_4_scaled_loop,
        lambda c: _planar_values(c, np.arange(16, dtype=np.float32), 4).astype(np.float64),
        0.0,
        1e-4,
    ),
    8: (_values8_scaled, ir_codes.tile_values_codes_8_scaled_loop, lambda c: c.astype(np.float64), 1e-5, None),
}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("impl", [0, 1], ids=["instructions", "loop"])
@pytest.mark.parametrize("g", [1, 3, 4, 6])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nt", [64, 13])
def test_scaled_values_from_int_codes(bits, impl, g, d, nt, rng):
    if impl == 0 and not cpu_features.HAVE_PERMPS:
        pytest.skip("no AVX-512")
    kernel, loop, values, rtol, atol_per_token = SCALED[bits]
    codes = rng.integers(0, 256, (100, d * bits // 8 + 8), dtype=np.uint8)[:, : d * bits // 8]
    w = rng.random((g, 64)).astype(np.float32)
    cscale = rng.random((64, d // 16)).astype(np.float32)
    acc = rng.standard_normal((g, d)).astype(np.float32)
    want = acc + w[:, :nt] @ (values(codes[9 : 9 + nt]) * np.repeat(cscale[:nt], 16, axis=1))
    (kernel if impl == 0 else loop)(codes, 9, nt, planar.table16(np.arange(16, dtype=np.float32)), w, cscale, acc)
    np.testing.assert_allclose(acc, want, rtol=rtol, atol=1e-3 if atol_per_token is None else atol_per_token * nt)


# ---- tokens along the lanes (4-bit product-quantization codes) ------------------------------


@nb.njit
def _lanes(codes, t0, nt, ahead, out):
    simd_lanes.codes_to_lanes(codes, t0, nt, ahead, out)


@nb.njit
def _lane_scores(lanes, nblk, nw, lut, s):
    simd_lanes.lane_table_scores(lanes, nblk, nw, lut, s)


@nb.njit
def _lane_values(lanes, nblk, nw, sd, ctab, w, acc):
    simd_lanes.lane_table_values(lanes, nblk, nw, sd, ctab, w, acc)


LANES = {
    0: (_lanes, _lane_scores, _lane_values),
    1: (simd_lanes.codes_to_lanes_loop, simd_lanes.lane_table_scores_loop, simd_lanes.lane_table_values_loop),
}


def _nibbles(codes):
    """NumPy: the 4-bit codes of each row, code ``j`` = nibble ``j % 2`` of byte ``j // 2``: (n, 2 · nbytes)."""
    return np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1).astype(np.int64)


@pytest.mark.parametrize("impl", [0, 1], ids=["instructions", "loop"])
@pytest.mark.parametrize("nbytes", [4, 8, 12, 16, 20, 28, 32, 64])
@pytest.mark.parametrize("nt", [1, 15, 16, 17, 64, 128])
def test_codes_to_lanes_transposes_dwords(impl, nbytes, nt, rng):
    if impl == 0 and not cpu_features.HAVE_PERMPS:
        pytest.skip("no AVX-512")
    codes = _codes(rng, 300, 2 * nbytes, 4)  # strided rows
    nw = nbytes // 4
    nblk = (nt + 15) // 16
    out = np.full((8 * nw + 3, 16), 7, np.int32)
    LANES[impl][0](codes, 21, nt, 64 * (nt % 2), out)  # prefetching (past the end too) changes nothing
    rows = 21 + np.minimum(np.arange(16 * nblk), nt - 1)  # lanes past the last row repeat it
    words = np.ascontiguousarray(codes[rows]).view(np.int32)  # (16 · nblk, nw), little-endian dwords
    want = words.reshape(nblk, 16, nw).transpose(0, 2, 1).reshape(nblk * nw, 16)
    np.testing.assert_array_equal(out[: nblk * nw], want)
    assert (out[nblk * nw :] == 7).all()


@pytest.mark.parametrize("impl", [0, 1], ids=["instructions", "loop"])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("nbytes", [4, 8, 16, 32])
@pytest.mark.parametrize("sd", [1, 2, 4])
@pytest.mark.parametrize("nt", [1, 17, 128])
def test_lane_table_scores_and_values(impl, g, nbytes, sd, nt, rng):
    if impl == 0 and not cpu_features.HAVE_PERMPS:
        pytest.skip("no AVX-512")
    to_lanes, scores, values = LANES[impl]
    codes = _codes(rng, 200, 2 * nbytes, 4)
    nw, m = nbytes // 4, 2 * nbytes
    d = m * sd
    nblk = (nt + 15) // 16
    lanes = np.empty((8 * nw, 16), np.int32)
    to_lanes(codes, 5, nt, 0, lanes)
    a = _nibbles(codes[5 + np.minimum(np.arange(16 * nblk), nt - 1)])  # (16 · nblk, m) codes per lane
    lut = rng.standard_normal((g, 128 * nw)).astype(np.float32)
    s = np.full((g, 16 * nblk + 16), 7.0, np.float32)
    scores(lanes, nblk, nw, lut, s)
    want = lut.astype(np.float64).reshape(g, m, 16)[:, np.arange(m), a].sum(axis=-1)  # (g, tokens)
    np.testing.assert_allclose(s[:, : 16 * nblk], want, rtol=0, atol=1e-5 * m)
    assert (s[:, 16 * nblk :] == 7.0).all()
    ctab = rng.standard_normal((d, 16)).astype(np.float32)
    w = rng.random((g, 16 * nblk)).astype(np.float32)
    acc = rng.standard_normal((g, 16 * d)).astype(np.float32)
    vals = ctab.astype(np.float64)[np.arange(d), a[:, np.arange(d) // sd]]  # (tokens, d)
    lane = vals.reshape(nblk, 16, d) * w.reshape(g, nblk, 16, 1)[:, :, :, :]  # (g, nblk, 16, d)
    want = acc.astype(np.float64) + lane.sum(axis=1).transpose(0, 2, 1).reshape(g, 16 * d)
    values(lanes, nblk, nw, sd, ctab, w, acc)
    np.testing.assert_allclose(acc, want, rtol=0, atol=1e-5 * nblk)


@nb.njit
def _lane_tables(q, tab, sd, lut):
    simd_lanes.lane_tables(q, tab, sd, lut)


@nb.njit
def _lane_sums(al, acc):
    simd_lanes.lane_sums(al, acc)


@pytest.mark.parametrize("impl", [0, 1], ids=["instructions", "loop"])
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("d", [8, 64, 128])
@pytest.mark.parametrize("sd", [1, 2, 4])
def test_lane_tables_and_sums(impl, g, d, sd, rng):
    if impl == 0 and not cpu_features.HAVE_PERMPS:
        pytest.skip("no AVX-512")
    tables, sums = (_lane_tables, _lane_sums) if impl == 0 else (simd_lanes.lane_tables_loop, simd_lanes.lane_sums_loop)
    q = rng.standard_normal((g, d)).astype(np.float32)
    tab = rng.standard_normal((d, 16)).astype(np.float32)
    m = d // sd
    lut = np.full((g, 16 * m + 32), 7.0, np.float32)
    tables(q, tab, sd, lut)
    want = (q.astype(np.float64).reshape(g, m, sd, 1) * tab.reshape(1, m, sd, 16)).sum(axis=2).reshape(g, 16 * m)
    np.testing.assert_allclose(lut[:, : 16 * m], want, rtol=0, atol=1e-5 * sd)
    assert (lut[:, 16 * m :] == 7.0).all()
    al = rng.standard_normal((g, 16 * d + 16)).astype(np.float32)
    acc = np.full((g, d), 7.0, np.float32)
    sums(al, acc)
    np.testing.assert_allclose(
        acc, al[:, : 16 * d].astype(np.float64).reshape(g, d, 16).sum(axis=-1), rtol=0, atol=1e-5
    )
