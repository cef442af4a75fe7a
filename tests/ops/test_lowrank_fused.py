"""The low-rank fused decode kernel against the array-API reference and a float64 dense attention."""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv import ops
from arraykv.attention.lowrank_fused import lowrank_decode_attention as reference
from arraykv.ops.numba import lowrank_fused as nf
from arraykv.quant.lowrank import LowRankLayerCoefficients


def _case(rng, *, b=1, h=2, g=1, d=64, r=8, T=7, E=0, coef=np.float16, extra=np.float16):
    """Random inputs: orthonormal bases, coefficients of a few units, float16 kept tokens.

    ``r`` is one rank for keys and values or a pair ``(r_k, r_v)``.
    """
    rk, rv = (r, r) if np.isscalar(r) else r

    def basis(rr):
        if rr <= d:
            return np.linalg.qr(rng.standard_normal((h, d, rr)))[0].astype(np.float32)
        return (rng.standard_normal((h, d, rr)) / np.sqrt(rr)).astype(np.float32)

    return dict(
        q=rng.standard_normal((b, h * g, 1, d)).astype(np.float32),
        k_coef=(rng.standard_normal((b, h, T, rk)) * 3).astype(coef),
        k_basis=basis(rk),
        k_mean=(rng.standard_normal((h, d)) * 0.5).astype(np.float32),
        v_coef=(rng.standard_normal((b, h, T, rv)) * 3).astype(coef),
        v_basis=basis(rv),
        v_mean=(rng.standard_normal((h, d)) * 0.5).astype(np.float32),
        k_extra=(rng.standard_normal((b, h, E, d)) * 2).astype(extra),
        v_extra=rng.standard_normal((b, h, E, d)).astype(extra),
    )


def _split(args):
    """``(q, layer coefficients, k_extra, v_extra)``: the ops' positional arguments from a case's dict."""
    names = ("k_coef", "k_basis", "k_mean", "v_coef", "v_basis", "v_mean")
    return args["q"], LowRankLayerCoefficients(*(args[n] for n in names)), args["k_extra"], args["v_extra"]


def _dense(q, k_coef, k_basis, k_mean, v_coef, v_basis, v_mean, k_extra, v_extra, *, softmax_scale):
    """float64 attention over the reconstructed keys/values ``μ + B c`` followed by the kept tokens."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    k = f(k_mean)[None, :, None, :] + np.einsum("hdr,bhtr->bhtd", f(k_basis), f(k_coef))
    v = f(v_mean)[None, :, None, :] + np.einsum("hdr,bhtr->bhtd", f(v_basis), f(v_coef))
    k = np.concatenate([k, f(k_extra)], axis=2)
    v = np.concatenate([v, f(v_extra)], axis=2)
    b, hq, _, d = q.shape
    h = k.shape[1]
    qg = f(q).reshape(b, h, hq // h, d)
    s = softmax_scale * np.einsum("bhgd,bhtd->bhgt", qg, k)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out = np.einsum("bhgt,bhtd->bhgd", p, v) / p.sum(axis=-1, keepdims=True)
    return out.reshape(b, hq, 1, d)


def _close(got, want, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30) if want.size else 0.0
    assert err <= rtol, err


F16, F32 = np.float16, np.float32
# (b, h, g, d, r, T, E, coefficient dtype): group sizes 1/3/4, head dims 64/128 (and others),
# ranks 8/32 (and unequal, and not multiples of 16: the loops beside the 16-lane products),
# contexts around a tile edge and across several tiles, with and without kept tokens, batch 1
# and 2, float16 and float32 coefficients.
SHAPES = [
    (1, 3, 3, 64, 32, 490, 24, F16),  # the SmolLM2-135M layer
    (2, 2, 1, 64, 8, 0, 5, F16),
    (1, 1, 4, 128, 32, 1, 0, F32),
    (2, 2, 3, 64, 8, 63, 5, F32),
    (1, 2, 4, 128, 8, 64, 0, F16),
    (2, 1, 1, 128, 32, 65, 5, F16),
    (1, 2, 3, 64, 32, 700, 0, F16),
    (2, 1, 4, 64, 32, 700, 5, F32),
    (1, 2, 1, 128, (8, 32), 257, 5, F16),
    (2, 1, 3, 24, (5, 3), 65, 5, F16),  # a head_dim without a specialised step (nor 16-lane rows), odd ranks
    (1, 2, 2, 16, 16, 300, 3, F16),  # a head_dim without a specialised step, 16-lane rows
]


def _ids(shape):
    b, h, g, d, r, T, E, dt = shape
    return f"b{b}h{h}g{g}d{d}r{r}T{T}E{E}-{np.dtype(dt).name}".replace(" ", "")


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_kernel_matches_reference_and_dense_attention(rng, shape):
    b, h, g, d, r, T, E, dt = shape
    args = _case(rng, b=b, h=h, g=g, d=d, r=r, T=T, E=E, coef=dt)
    scale = d**-0.5
    got = nf.lowrank_decode_attention(*_split(args), softmax_scale=scale)
    assert got.dtype == np.float32 and got.shape == (b, h * g, 1, d)
    _close(got, reference(*_split(args), softmax_scale=scale))
    _close(got, _dense(**args, softmax_scale=scale))


def test_no_coded_tokens_needs_no_basis(rng):
    """``T = 0``: bases and means may be None, as the cache passes them before its fit."""
    args = _case(rng, b=2, h=2, g=3, d=64, T=0, E=5)
    args.update(k_basis=None, k_mean=None, v_basis=None, v_mean=None)
    want = _dense(
        **dict(
            args,
            k_basis=np.zeros((2, 64, 8)),
            k_mean=np.zeros((2, 64)),
            v_basis=np.zeros((2, 64, 8)),
            v_mean=np.zeros((2, 64)),
        ),
        softmax_scale=0.125,
    )
    _close(nf.lowrank_decode_attention(*_split(args), softmax_scale=0.125), want)
    _close(reference(*_split(args), softmax_scale=0.125), want)


def test_strided_and_noncontiguous_inputs(rng):
    """Coefficients sliced from a longer buffer (the cache's layout), strided along tokens or
    channels, transposed bases, a strided query and strided kept tokens."""
    args = _case(rng, b=2, h=2, g=3, d=64, r=32, T=300, E=5)
    want = reference(*_split(args), softmax_scale=0.125)

    def buffer(c):  # a token buffer with room for more: the cache's view of its first T tokens
        big = np.zeros(c.shape[:2] + (512, c.shape[3]), c.dtype)
        big[:, :, :300] = c
        return big[:, :, :300]

    def every_other_token(c):
        big = np.zeros(c.shape[:2] + (600, c.shape[3]), c.dtype)
        big[:, :, ::2] = c
        return big[:, :, ::2]

    def every_other_channel(c):
        big = np.zeros(c.shape[:3] + (2 * c.shape[3],), c.dtype)
        big[..., ::2] = c
        return big[..., ::2]

    for make in (buffer, every_other_token, every_other_channel, np.asfortranarray):
        a = dict(args, k_coef=make(args["k_coef"]), v_coef=make(args["v_coef"]))
        assert not a["k_coef"].flags.c_contiguous
        _close(nf.lowrank_decode_attention(*_split(a), softmax_scale=0.125), want)
    q = np.zeros((2, 6, 2, 64), np.float32)
    q[:, :, :1] = args["q"]
    ke = np.zeros((2, 2, 10, 64), np.float16)
    ke[:, :, ::2] = args["k_extra"]
    a = dict(
        args,
        q=q[:, :, :1],
        k_extra=ke[:, :, ::2],
        v_extra=np.asfortranarray(args["v_extra"]),
        k_basis=np.ascontiguousarray(args["k_basis"].transpose(0, 2, 1)).transpose(0, 2, 1),
        k_coef=every_other_token(args["k_coef"]),
    )
    _close(nf.lowrank_decode_attention(*_split(a), softmax_scale=0.125), want)


def test_dtypes(rng):
    """q of any float dtype gives that dtype; float64 state and float32 kept tokens are read as float32."""
    args = _case(rng, b=1, h=2, g=2, d=64, r=8, T=100, E=5)
    want = _dense(**args, softmax_scale=0.125)
    for dt, tol in ((np.float16, 2e-3), (np.float32, 1e-5), (np.float64, 1e-5)):
        got = nf.lowrank_decode_attention(*_split(dict(args, q=args["q"].astype(dt))), softmax_scale=0.125)
        assert got.dtype == dt
        _close(got, _dense(**dict(args, q=args["q"].astype(dt)), softmax_scale=0.125), tol)
    wide = {k: v.astype(np.float64) for k, v in args.items()}
    got = nf.lowrank_decode_attention(*_split(dict(wide, q=args["q"])), softmax_scale=0.125)
    _close(got, want)
    mixed = dict(args, k_extra=args["k_extra"].astype(np.float32), v_coef=args["v_coef"].astype(np.float32))
    _close(nf.lowrank_decode_attention(*_split(mixed), softmax_scale=0.125), want)


@pytest.mark.parametrize("scale", [30.0, 1000.0])
def test_large_logits_are_stable(rng, scale):
    """Logits spanning thousands, rising along the context: the running maximum moves up tile after tile."""
    args = _case(rng, b=1, h=2, g=3, d=64, r=8, T=1200, E=5)
    args["k_coef"] = (args["k_coef"] + np.linspace(0, 20, 1200)[None, None, :, None]).astype(np.float16)
    got = nf.lowrank_decode_attention(*_split(args), softmax_scale=scale)
    assert np.all(np.isfinite(got))
    _close(got, reference(*_split(args), softmax_scale=scale), 1e-4)


def test_value_rank_above_head_dim_runs_the_reference(rng):
    args = _case(rng, b=1, h=1, g=2, d=16, r=(8, 24), T=30, E=2)
    _close(nf.lowrank_decode_attention(*_split(args), softmax_scale=0.25), _dense(**args, softmax_scale=0.25))


BAD = {
    "q rank": lambda a: dict(a, q=a["q"][:, :, 0]),
    "q two tokens": lambda a: dict(a, q=np.concatenate([a["q"], a["q"]], axis=2)),
    "q heads": lambda a: dict(a, q=a["q"][:, :5]),
    "q head_dim": lambda a: dict(a, q=a["q"][..., :32]),
    "k_extra batch": lambda a: dict(a, k_extra=a["k_extra"][:1]),
    "v_extra tokens": lambda a: dict(a, v_extra=a["v_extra"][:, :, :2]),
    "v_extra head_dim": lambda a: dict(a, v_extra=a["v_extra"][..., :32]),
    "k_coef heads": lambda a: dict(a, k_coef=a["k_coef"][:, :1]),
    "v_coef tokens": lambda a: dict(a, v_coef=a["v_coef"][:, :, :5]),
    "k_basis rank": lambda a: dict(a, k_basis=a["k_basis"][..., :4]),
    "v_basis head_dim": lambda a: dict(a, v_basis=a["v_basis"][:, :32]),
    "k_mean missing": lambda a: dict(a, k_mean=None),
    "v_mean heads": lambda a: dict(a, v_mean=a["v_mean"][:1]),
    "no token": lambda a: dict(
        a,
        k_coef=a["k_coef"][:, :, :0],
        v_coef=a["v_coef"][:, :, :0],
        k_extra=a["k_extra"][:, :, :0],
        v_extra=a["v_extra"][:, :, :0],
    ),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_shapes_are_refused_like_the_reference(rng, bad):
    args = BAD[bad](_case(rng, b=2, h=2, g=3, d=64, r=8, T=20, E=3))
    fns = [reference] + ([nf.lowrank_decode_attention] if nf is not None else [])
    for fn in fns:
        with pytest.raises(ValueError):
            fn(*_split(args), softmax_scale=0.125)
    for fn in fns:
        with pytest.raises(ValueError, match="softmax_scale"):
            fn(*_split(_case(rng)), softmax_scale=-1.0)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_threaded_kernel_and_token_splits(rng, splits, monkeypatch):
    """The threaded step, forced, with 1–7 token spans per head (empty ones included) merged by log-sum-exp."""
    if nf.nb.get_num_threads() < 2:
        pytest.skip("Numba has one thread")
    args = _case(rng, b=2, h=2, g=3, d=64, r=32, T=3000, E=5)
    serial = nf.lowrank_decode_attention(*_split(args), softmax_scale=0.125)
    calls = []
    real = nf._step_parallel

    def spy(*a):
        calls.append(a[-2])
        return real(*a)

    monkeypatch.setattr(nf, "_plan", lambda bh, n, r: (nf.nb.get_num_threads(), splits))
    monkeypatch.setattr(nf, "_step_parallel", spy)
    got = nf.lowrank_decode_attention(*_split(args), softmax_scale=0.125)
    assert calls == [splits]
    _close(got, serial)
    _close(got, reference(*_split(args), softmax_scale=0.125))
    few = _case(rng, b=1, h=2, g=1, d=64, r=8, T=3, E=2)  # more spans than tokens
    _close(nf.lowrank_decode_attention(*_split(few), softmax_scale=0.125), reference(*_split(few), softmax_scale=0.125))


def test_long_contexts_use_threads_and_small_steps_do_not(rng, monkeypatch, parallel_threshold):
    """The shared threading policy: the SmolLM2-shape step stays on the calling thread; a long
    context (here: any step, the threshold at 1) runs the threaded step with the same result."""
    if nf.nb.get_num_threads() < 2:
        pytest.skip("Numba has one thread")
    args = _case(rng, b=1, h=3, g=3, d=64, r=32, T=490, E=24)

    def fail(*a):
        raise AssertionError("the threaded kernel ran for a small step")

    monkeypatch.setattr(nf, "_step_parallel", fail)
    serial = nf.lowrank_decode_attention(*_split(args), softmax_scale=0.125)
    monkeypatch.undo()
    calls = []
    real = nf._step_parallel

    def spy(*a):
        calls.append(a[-2])
        return real(*a)

    monkeypatch.setattr(nf, "_step_parallel", spy)
    parallel_threshold(1)
    long_args = _case(rng, b=1, h=3, g=3, d=64, r=32, T=4000, E=24)
    got = nf.lowrank_decode_attention(*_split(long_args), softmax_scale=0.125)
    assert len(calls) == 1 and calls[0] >= 2
    _close(got, reference(*_split(long_args), softmax_scale=0.125))
    _close(nf.lowrank_decode_attention(*_split(args), softmax_scale=0.125), serial)


def test_op_is_registered_and_falls_back(rng):
    args = _case(rng, b=1, h=2, g=2, d=64, r=8, T=30, E=3)
    want = reference(*_split(args), softmax_scale=0.125)
    assert ops.has_kernel("lowrank_decode_attention", arraykv._compat.namespace(args["q"])) is (nf is not None)
    _close(ops.lowrank_decode_attention(*_split(args), softmax_scale=0.125), want)
    with ops.set_kernels_enabled(False):
        assert ops.implementation("lowrank_decode_attention", arraykv._compat.namespace(args["q"])) is reference
        _close(ops.lowrank_decode_attention(*_split(args), softmax_scale=0.125), want)


@pytest.mark.parametrize("coeff_dtype", ["float16", "float32"])
def test_cache_decode_runs_the_kernel(rng, coeff_dtype, monkeypatch):
    """``lowrank`` decode goes through the op (the kernel on NumPy) and agrees with kernels off."""
    h, g, d = 2, 3, 64
    k, v = (rng.standard_normal((1, h, 200, d)).astype(np.float32) for _ in "kv")
    q0 = rng.standard_normal((1, h * g, 200, d)).astype(np.float32)
    step = [rng.standard_normal((1, h, 1, d)).astype(np.float32) for _ in "kv"]
    q = rng.standard_normal((1, h * g, 1, d)).astype(np.float32)
    config = arraykv.AttendConfig(softmax_scale=d**-0.5, n_kv_groups=g)

    def decode():
        cache = arraykv.make_cache(
            "lowrank",
            num_layers=1,
            num_kv_heads=h,
            head_dim=d,
            rank=16,
            coeff_dtype=coeff_dtype,
            residual_window=8,
            sink_tokens=2,
        )
        cache.prefill(0, k, v, q0)
        return cache.decode(0, step[0], step[1], q, config).output

    calls = []
    real = nf.lowrank_decode_attention
    monkeypatch.setattr(nf, "lowrank_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    from arraykv.ops import registry

    monkeypatch.setattr(registry, "_RESOLVED", {})
    got = decode()
    assert calls == [1]
    with ops.set_kernels_enabled(False):
        want = decode()
    assert calls == [1]
    _close(got, want)
