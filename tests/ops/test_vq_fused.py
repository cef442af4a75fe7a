"""Fused VQ decode attention (ADC scores, histogram value sums) against the array-API reference."""

from __future__ import annotations

import tracemalloc
from functools import partial

import numpy as np
import pytest

import arraykv
from arraykv.attention.vq_fused import vq_decode_attention_reference
from arraykv.ops import lookup
from arraykv.ops.numba import vq_fused as nf
from arraykv.quant.bitpack import pack_bits
from arraykv.quant.vq import VQLayerCodes, code_bits

from conftest import asarray, to_np


def _case(rng, *, b=1, h=2, g=1, d=32, K=16, s=2, T=7, E=0, kv_K=None, scale_q=1.0):
    """Random NumPy inputs: uniform codes, normal codebooks/queries, float16 extra tokens."""
    m = d // s
    kv_K = K if kv_K is None else kv_K
    bits = code_bits(max(K, kv_K))

    def codes(k):
        a = rng.integers(0, k, (b, h, T, m))
        return pack_bits(a.astype(np.uint8), bits) if bits <= 8 else a.astype(np.uint16)

    args = dict(
        q=(rng.standard_normal((b, h * g, d)) * scale_q).astype(np.float32),
        k_codes=codes(K),
        k_centroids=rng.standard_normal((h, m, K, s)).astype(np.float32),
        v_codes=codes(kv_K),
        v_centroids=rng.standard_normal((h, m, kv_K, s)).astype(np.float32),
        k_extra=rng.standard_normal((b, h, E, d)).astype(np.float16),
        v_extra=rng.standard_normal((b, h, E, d)).astype(np.float16),
    )
    return args, bits


def _split(args, bits):
    """``(q, layer codes, k_extra, v_extra)``: the ops' positional arguments from a case's dict."""
    codes = VQLayerCodes(args["k_codes"], args["k_centroids"], args["v_codes"], args["v_centroids"], bits)
    return args["q"], codes, args["k_extra"], args["v_extra"]


def _naive(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, *, bits, softmax_scale):
    """Token-by-token float64 loops: unpack each code from its bits, look its centroid up."""
    b, hq, d = q.shape
    h, m, _, s = k_centroids.shape
    g = hq // h
    T, E = k_codes.shape[2], k_extra.shape[2]

    def code(row, j):
        if bits > 8:
            return int(row[j])
        val = 0
        for i in range(bits):
            pos = j * bits + i
            val |= ((int(row[pos // 8]) >> (pos % 8)) & 1) << i
        return val

    out = np.zeros((b, hq, d))
    for bi in range(b):
        for qi in range(hq):
            kh = qi // g
            keys, vals = [], []
            for t in range(T):
                keys.append(np.concatenate([k_centroids[kh, j, code(k_codes[bi, kh, t], j)] for j in range(m)]))
                vals.append(np.concatenate([v_centroids[kh, j, code(v_codes[bi, kh, t], j)] for j in range(m)]))
            for t in range(E):
                keys.append(k_extra[bi, kh, t])
                vals.append(v_extra[bi, kh, t])
            kk = np.asarray(keys, np.float64)
            vv = np.asarray(vals, np.float64)
            logits = softmax_scale * (kk @ q[bi, qi].astype(np.float64))
            p = np.exp(logits - logits.max())
            out[bi, qi] = (p / p.sum()) @ vv
    return out


def _close(got, want, rtol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= rtol, err


# (b, h, g, d, K, s, T, E): every codebook size, sub_dim, head_dim, group, batch, extra count and
# context of the brief appears; 5000 tokens cross many tiles (and token splits when threaded).
SHAPES = [
    (1, 2, 1, 32, 2, 1, 1, 0),
    (3, 2, 4, 32, 2, 4, 7, 5),
    (1, 3, 3, 64, 16, 2, 300, 0),
    (3, 1, 4, 64, 16, 8, 7, 5),
    (1, 2, 4, 128, 16, 1, 5000, 5),
    (3, 2, 1, 32, 256, 2, 300, 5),
    (1, 1, 4, 64, 256, 8, 5000, 0),
    (1, 2, 1, 128, 256, 4, 1, 5),
    (1, 2, 4, 32, 300, 2, 300, 5),  # uint16 codes
    (3, 1, 1, 64, 1000, 4, 5000, 0),  # uint16 codes, tables
    (1, 1, 4, 32, 5, 2, 300, 5),  # 3-bit codes
    (1, 2, 1, 64, 100, 8, 300, 0),  # 7-bit codes
    (1, 1, 1, 32, 16, 2, 0, 5),  # no coded tokens, only the dense ones
    (2, 1, 4, 24, 16, 8, 300, 5),  # 4-bit pair tables with an odd number of sub-spaces
    (1, 2, 4, 24, 9, 4, 300, 0),  # 4-bit codes of a 9-entry codebook
]


def _ids(shape):
    return "b{}h{}g{}d{}K{}s{}T{}E{}".format(*shape)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[6] <= 300], ids=_ids)
def test_reference_matches_naive_loop(xp, rng, shape):
    b, h, g, d, K, s, T, E = shape
    args, bits = _case(rng, b=b, h=h, g=g, d=d, K=K, s=s, T=T, E=E)
    scale = d**-0.5
    want = _naive(**args, bits=bits, softmax_scale=scale)
    # array_api_strict has no float16: the dense tokens go in as float32 there
    conv = {
        k: asarray(xp, v, np.float32 if v.dtype == np.float16 and not hasattr(xp, "float16") else None)
        for k, v in args.items()
    }
    got = vq_decode_attention_reference(*_split(conv, bits), softmax_scale=scale)
    assert got.dtype == xp.float32 and tuple(got.shape) == (b, h * g, d)
    _close(to_np(got), want)


def _skip_unless_lanes(mode, args, bits):
    """Skip a forced lanes path where the call cannot take it (no AVX-512, codes that do not fit)."""
    if mode == "lanes" and not nf._lanes_fit(
        bits,
        args["k_centroids"].shape[2],
        args["v_centroids"].shape[2],
        args["q"].shape[2],
        args["k_codes"],
        args["v_codes"],
    ):
        pytest.skip("the lanes path does not serve this call")


@pytest.mark.parametrize("mode", [None, "tables", "direct", "lanes"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_kernel_matches_reference(rng, shape, mode, monkeypatch):
    b, h, g, d, K, s, T, E = shape
    monkeypatch.setattr(nf, "vq_decode_attention", partial(nf.decode_attention_mode, mode=mode))
    args, bits = _case(rng, b=b, h=h, g=g, d=d, K=K, s=s, T=T, E=E)
    _skip_unless_lanes(mode, args, bits)
    scale = d**-0.5
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=scale)
    got = nf.vq_decode_attention(*_split(args, bits), softmax_scale=scale)
    assert got.dtype == np.float32 and got.shape == (b, h * g, d)
    _close(got, want)


def test_different_key_and_value_codebook_sizes(rng):
    args, bits = _case(rng, b=2, h=2, g=2, d=32, K=16, kv_K=5, s=2, T=300, E=3)
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=0.2)
    for mode in ("tables", "direct") + (("lanes",) if nf.VECTOR_TILES else ()):
        _close(nf.decode_attention_mode(*_split(args, bits), softmax_scale=0.2, mode=mode), want)


@pytest.mark.parametrize("mode", ["tables", "direct", "lanes"])
@pytest.mark.parametrize("scale", [30.0, 1000.0])
def test_large_logit_ranges_are_stable(rng, mode, scale, monkeypatch):
    """Logits spanning thousands: the running maximum rises across tiles, the weights never overflow."""
    monkeypatch.setattr(nf, "vq_decode_attention", partial(nf.decode_attention_mode, mode=mode))
    args, bits = _case(rng, b=1, h=2, g=4, d=64, K=16, s=2, T=5000, E=5)
    _skip_unless_lanes(mode, args, bits)
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=scale)
    got = nf.vq_decode_attention(*_split(args, bits), softmax_scale=scale)
    assert np.all(np.isfinite(got))
    _close(got, want)
    # key codes that rise with the token index: the running maximum moves up tile after tile
    # and the histograms are rescaled many times
    m = 32
    a = np.minimum(np.arange(5000) * 16 // 5000, 15)
    rising = np.broadcast_to(a[None, None, :, None], (1, 2, 5000, m)).astype(np.uint8)
    cent = np.broadcast_to(np.linspace(-1, 1, 16, dtype=np.float32)[None, None, :, None], (2, m, 16, 2))
    args.update(k_codes=pack_bits(np.ascontiguousarray(rising), 4), k_centroids=np.ascontiguousarray(cent))
    args["q"] = np.abs(args["q"])
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=scale)
    got = nf.vq_decode_attention(*_split(args, bits), softmax_scale=scale)
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(want))
    _close(got, want)


def test_float16_query_and_strided_codes(rng):
    """Any float dtype for q and the codebooks, codes read in place through strides."""
    args, bits = _case(rng, b=2, h=2, g=2, d=64, K=16, s=2, T=301, E=2)
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=0.1)
    wide = np.zeros(args["k_codes"].shape[:2] + (602, args["k_codes"].shape[3]), np.uint8)
    wide[:, :, ::2] = args["k_codes"]
    args = dict(args, k_codes=wide[:, :, ::2], k_centroids=args["k_centroids"].astype(np.float64))
    _close(nf.vq_decode_attention(*_split(args, bits), softmax_scale=0.1), want)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("mode", ["tables", "direct", "lanes"])
def test_parallel_kernel_and_token_splits(rng, splits, mode, monkeypatch, parallel_threshold):
    """The threaded kernel, forced on a small step, with 1–7 spans per head (empty ones included)."""
    if nf.nb.get_num_threads() < 2:
        pytest.skip("Numba has one thread")
    args, bits = _case(rng, b=2, h=2, g=4, d=32, K=16, s=2, T=200, E=5)
    _skip_unless_lanes(mode, args, bits)
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=0.3)
    calls = []
    real = nf._step_parallel

    def spy(*a):
        calls.append(a[-2])
        return real(*a)

    monkeypatch.setattr(nf, "vq_decode_attention", partial(nf.decode_attention_mode, mode=mode))
    parallel_threshold(0)
    monkeypatch.setattr(nf, "_splits", lambda bh, n, threads, span: splits)
    monkeypatch.setattr(nf, "_step_parallel", spy)
    _close(nf.vq_decode_attention(*_split(args, bits), softmax_scale=0.3), want)
    assert calls == [splits]
    # more spans than tokens: trailing spans are empty
    few, _ = _case(rng, b=1, h=2, g=1, d=32, K=16, s=2, T=3, E=0)
    _close(
        nf.vq_decode_attention(*_split(few, bits), softmax_scale=0.3),
        vq_decode_attention_reference(*_split(few, bits), softmax_scale=0.3),
    )


def test_small_steps_run_serially(rng, monkeypatch):
    def fail(*a):
        raise AssertionError("the threaded kernel ran for a small step")

    monkeypatch.setattr(nf, "_step_parallel", fail)
    args, bits = _case(rng, b=1, h=3, g=3, d=64, K=16, s=2, T=500)
    nf.vq_decode_attention(*_split(args, bits), softmax_scale=0.125)


#: (b, h, g, d, K, s): sub_dim 1, 2 and 4; codebooks of 16 and 9 entries (4-bit codes), 5 (3 bits),
#: 256 (8 bits) and 300 (uint16); 1, 3 and 4 query heads per KV head; batch 2
FRESH = [
    (2, 3, 3, 64, 16, 2),
    (1, 2, 1, 64, 16, 1),
    (2, 1, 4, 128, 16, 4),
    (1, 2, 3, 64, 9, 2),
    (2, 1, 4, 32, 16, 2),
    (1, 2, 3, 32, 5, 1),
    (2, 1, 3, 64, 256, 2),
    (1, 2, 4, 32, 300, 4),
]


@pytest.mark.parametrize("mode", [None, "tables", "direct", "lanes"])
@pytest.mark.parametrize("T", [0, 1, 15, 16, 17, 64, 65, 1000])
@pytest.mark.parametrize("shape", FRESH, ids=lambda x: "b{}h{}g{}d{}K{}s{}".format(*x))
def test_every_path_on_fresh_inputs(rng, shape, T, mode):
    """Every path against the reference, contexts around the 16-token blocks and 64-token tiles."""
    b, h, g, d, K, s = shape
    args, bits = _case(rng, b=b, h=h, g=g, d=d, K=K, s=s, T=T, E=0 if T % 2 else 6, scale_q=2.0)
    _skip_unless_lanes(mode, args, bits)
    scale = d**-0.5
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=scale)
    got = nf.decode_attention_mode(*_split(args, bits), softmax_scale=scale, mode=mode)
    assert got.dtype == np.float32 and got.shape == (b, h * g, d)
    _close(got, want)


def test_lanes_fit():
    rng = np.random.default_rng(0)
    args, _ = _case(rng, b=1, h=2, g=2, d=64, K=16, s=2, T=20)
    kc, vc = args["k_codes"], args["v_codes"]
    fits = nf._lanes_fit(4, 16, 16, 64, kc, vc)
    assert fits == nf.VECTOR_TILES
    assert not nf._lanes_fit(4, 17, 16, 64, kc, vc)  # codebook too large for one register
    assert not nf._lanes_fit(3, 8, 8, 64, kc, vc)  # not 4-bit codes
    assert not nf._lanes_fit(4, 16, 16, 60, kc, vc)  # head_dim not a multiple of 8
    wide = np.zeros(kc.shape[:3] + (2 * kc.shape[3],), np.uint8)
    assert not nf._lanes_fit(4, 16, 16, 64, wide[..., ::2], vc)  # bytes of a row not contiguous
    odd, _ = _case(rng, b=1, h=1, g=1, d=24, K=16, s=4, T=3)  # 6 codes: rows of 3 bytes
    assert not nf._lanes_fit(4, 16, 16, 24, odd["k_codes"], odd["v_codes"])
    if not fits:
        with pytest.raises(ValueError, match="lanes"):
            nf.decode_attention_mode(*_split(args, 4), softmax_scale=0.1, mode="lanes")


@pytest.mark.parametrize("mode", [None, "tables", "direct"])
@pytest.mark.parametrize("extra", ["float16", "float16-strided", "float32", "float64", "mixed"])
def test_dense_token_dtypes(rng, extra, mode):
    """float16 dense tokens are read as bit patterns and converted in the kernel: same result as float32."""
    args, bits = _case(rng, b=2, h=2, g=3, d=64, K=16, s=2, T=100, E=7)
    k16, v16 = args["k_extra"], args["v_extra"]
    want = vq_decode_attention_reference(*_split(args, bits), softmax_scale=0.2)
    if extra == "float16-strided":
        wide = np.zeros(k16.shape[:2] + (14, 64), np.float16)
        wide[:, :, ::2] = k16
        args["k_extra"] = wide[:, :, ::2]
    elif extra in ("float32", "float64"):
        args.update(k_extra=k16.astype(extra), v_extra=v16.astype(extra))
    elif extra == "mixed":
        args["v_extra"] = v16.astype(np.float32)
    _close(nf.decode_attention_mode(*_split(args, bits), softmax_scale=0.2, mode=mode), want)


def test_float16_bits_convert_exactly():
    """Every float16 bit pattern (subnormals, infinities and NaNs included) becomes its float32 value."""

    @nf.nb.njit
    def convert(x, out):
        nf._dense_f32(x, 0, 0, out)

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty((256, 256), np.float32)
    convert(bits.reshape(1, 1, 256, 256), out)
    want = bits.view(np.float16).astype(np.float32).reshape(256, 256)
    np.testing.assert_array_equal(out, want)  # NaNs at the same places, the same signs


def test_fast_argument_checks_agree_with_the_full_ones(rng):
    """The plain-attribute checks of a NumPy call accept exactly what the full checks accept, with the same shapes."""
    from arraykv.quant.vq import check_decode_attention_args

    base, bits = _case(rng, b=2, h=2, g=2, d=32, K=16, s=2, T=5, E=3)
    variants = [
        dict(),
        dict(q=base["q"].astype(np.float16)),
        dict(k_extra=base["k_extra"][:, :, :0], v_extra=base["v_extra"][:, :, :0]),
        dict(q=base["q"][:, :3]),
        dict(q=base["q"].astype(np.int32)),
        dict(q=base["q"][0]),
        dict(k_codes=base["k_codes"][:, :, :4]),
        dict(v_codes=base["v_codes"].astype(np.uint16)),
        dict(k_codes=base["k_codes"][:1]),
        dict(k_centroids=base["k_centroids"][:, :8]),
        dict(v_centroids=base["v_centroids"][:1]),
        dict(k_centroids=base["k_centroids"].astype(np.float16)),
        dict(k_extra=base["k_extra"][..., :16]),
        dict(v_extra=base["v_extra"][:, :, :2]),
        dict(k_extra=base["k_extra"].astype(np.int8)),
        dict(k_extra=base["k_extra"][0]),
        dict(
            k_codes=base["k_codes"][:, :, :0],
            v_codes=base["v_codes"][:, :, :0],
            k_extra=base["k_extra"][:, :, :0],
            v_extra=base["v_extra"][:, :, :0],
        ),
        dict(q=list(base["q"])),
    ]
    for bits_arg in (bits, 3, 0, 17, np.int64(bits), True, 4.0):
        for change in variants:
            a = dict(base, **change)
            order = [a[k] for k in ("q", "k_codes", "k_centroids", "v_codes", "v_centroids", "k_extra", "v_extra")]
            fast = nf._numpy_shapes(*order, bits_arg)
            try:
                full = check_decode_attention_args(*order, bits_arg)
            except (TypeError, ValueError, AttributeError):
                full = None
            assert fast is None or fast == full, (change.keys(), bits_arg, fast, full)
    assert (
        nf._numpy_shapes(
            *[base[k] for k in ("q", "k_codes", "k_centroids", "v_codes", "v_centroids", "k_extra", "v_extra")], bits
        )
        is not None
    )


def test_mode_choice():
    assert not nf._use_tables(16, 16, 2, 7)
    assert nf._use_tables(16, 16, 2, 500)
    assert nf._use_tables(16, 16, 1, 500)
    assert not nf._use_tables(256, 256, 2, 300)
    assert not nf._use_tables(65536, 65536, 2, 10**6)


@pytest.mark.parametrize("threaded", [False, True])
def test_step_memory_does_not_grow_with_context(rng, threaded, monkeypatch, parallel_threshold):
    """Peak traced allocation of one step is about the same at 1k and 8k tokens.

    Decoded float32 K/V of the extra 7000 tokens would be 7000 * 4 * 128 * 4 * 2 = 28 MB.
    """
    parallel_threshold(0 if threaded else 1 << 62)
    args, bits = _case(rng, b=1, h=4, g=4, d=128, K=16, s=2, T=8000, E=5)

    def peak(n):
        a = dict(args, k_codes=args["k_codes"][:, :, :n], v_codes=args["v_codes"][:, :, :n])
        nf.vq_decode_attention(*_split(a, bits), softmax_scale=0.1)  # compiled and warm
        tracemalloc.start()
        nf.vq_decode_attention(*_split(a, bits), softmax_scale=0.1)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(1024), peak(8000)
    margin = 128 * 1024 * nf.nb.get_num_threads() if threaded else 16 * 1024
    assert large <= small + margin, (small, large)


def test_kernel_is_registered_for_numpy():
    assert lookup("vq_decode_attention", arraykv._compat.namespace(np.zeros(1))) is nf.vq_decode_attention


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=np.zeros((1, 3, 32), np.float32)), "multiple"),
        (dict(k_codes=np.zeros((1, 2, 7, 16), np.uint16)), "k_codes"),
        (dict(v_codes=np.zeros((1, 2, 6, 16), np.uint8)), "v_codes"),
        (dict(k_extra=np.zeros((1, 2, 1, 32), np.float16)), "v_extra"),
        (dict(v_centroids=np.zeros((2, 8, 16, 4), np.float32)), "v_centroids"),
    ],
)
def test_bad_inputs_are_rejected(rng, change, match):
    args, bits = _case(rng, b=1, h=2, g=1, d=32, K=16, s=2, T=7)
    args.update(change)
    fns = [vq_decode_attention_reference] + ([nf.vq_decode_attention] if nf is not None else [])
    for fn in fns:
        with pytest.raises(ValueError, match=match):
            fn(*_split(args, bits), softmax_scale=0.1)
