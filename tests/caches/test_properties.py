"""Property-based tests: random shapes, head_dims, bits, batches, dtypes and token counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import arraykv
from arraykv.quant.bitpack import pack_bits, unpack_bits
from arraykv.storage import TokenBuffers

from conftest import BUILTIN_METHODS
from naive import attention_loops

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    bits=st.integers(1, 8),
    lead=st.lists(st.integers(1, 4), max_size=2),
    n=st.integers(0, 70),
    seed=st.integers(0, 2**31),
)
def test_bitpack_round_trip(bits, lead, n, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=tuple(lead) + (n,), dtype=np.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape[-1] == (n * bits + 7) // 8
    np.testing.assert_array_equal(unpack_bits(packed, bits, n), codes)


@SETTINGS
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    g=st.integers(1, 3),
    t=st.integers(1, 4),
    extra=st.integers(0, 6),
    d=st.integers(1, 9),
    causal=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_attention_matches_loops(b, hkv, g, t, extra, d, causal, seed):
    rng = np.random.default_rng(seed)
    s = t + extra
    q = rng.standard_normal((b, hkv * g, t, d))
    k, v = rng.standard_normal((b, hkv, s, d)), rng.standard_normal((b, hkv, s, d))
    np.testing.assert_allclose(
        arraykv.attention(q, k, v, softmax_scale=0.7, causal=causal),
        attention_loops(q, k, v, 0.7, causal=causal),
        rtol=1e-9,
        atol=1e-12,
    )


@SETTINGS
@given(chunks=st.lists(st.integers(1, 50), min_size=1, max_size=30), tail=st.integers(1, 5))
def test_token_buffers_equal_concatenation(chunks, tail):
    buf = TokenBuffers(min_capacity=4)
    rng = np.random.default_rng(len(chunks))
    parts = []
    for t in chunks:
        a = rng.standard_normal((2, 1, t, tail)).astype(np.float32)
        buf.append({"a": a, "b": a[..., :1] * 2})
        parts.append(a)
    whole = np.concatenate(parts, axis=2)
    np.testing.assert_array_equal(buf.view("a"), whole)
    np.testing.assert_array_equal(buf.view("b"), whole[..., :1] * 2)
    assert buf.length == whole.shape[2] <= buf.capacity
    assert buf.used_nbytes() == whole.nbytes + whole.nbytes // tail


@pytest.mark.parametrize("method", BUILTIN_METHODS)
@SETTINGS
@given(
    head_dim=st.sampled_from([8, 16, 24, 32, 40, 48, 64, 96, 128]),
    kv_heads=st.integers(1, 3),
    groups=st.integers(1, 3),
    batch=st.integers(1, 3),
    dtype=st.sampled_from(["float16", "float32"]),
    steps=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
)
@example(head_dim=48, kv_heads=1, groups=3, batch=1, dtype="float16", steps=[20, 18], seed=0)
@example(head_dim=96, kv_heads=1, groups=1, batch=1, dtype="float16", steps=[14, 19], seed=0)
def test_random_geometry_works_or_is_refused_clearly(method, head_dim, kv_heads, groups, batch, dtype, steps, seed):
    try:
        cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim)
    except ValueError as exc:
        assert "head_dim" in str(exc)  # the only geometry a method may refuse, and it says so
        return
    # a stream of its own: default_rng(0) is also the stream the caches' rotation (seed 0) is
    # drawn from, and keys that are the rotation's own Gaussian rows are not random to it
    # (seed 0 made pqo4 store the first head_dim keys with 13-30 % error at head_dim 96)
    rng = np.random.default_rng((seed, 1))
    scale = head_dim**-0.5
    cfg = arraykv.AttendConfig(scale, groups)
    total = 0
    given_k = []
    for t in steps:
        k = rng.standard_normal((batch, kv_heads, t, head_dim)).astype(dtype)
        v = rng.standard_normal((batch, kv_heads, t, head_dim)).astype(dtype)
        q = rng.standard_normal((batch, kv_heads * groups, t, head_dim)).astype(dtype)
        total += t
        given_k.append(k)
        if t == 1:
            out = cache.decode(1, k, v, q, cfg)
            o = out.output if isinstance(out, arraykv.Fused) else None
            if o is None:
                r = out.result
                assert r.k.shape == (batch, kv_heads, total, head_dim)
                o = arraykv.attention(q, r.k, r.v, softmax_scale=scale, logit_bias=r.logit_bias)
            assert o.shape == (batch, kv_heads * groups, 1, head_dim) and o.dtype == np.dtype(dtype)
            assert np.all(np.isfinite(o.astype(np.float32)))
        else:
            r = cache.prefill(1, k, v, q)
            assert r.k.shape == (batch, kv_heads, total, head_dim) and r.k.dtype == np.dtype(dtype)
        assert cache.seq_len(1) == total
    exact = np.concatenate(given_k, axis=2).astype(np.float64)
    got = cache.dequantize(1).k.astype(np.float64)
    rel = float(((got - exact) ** 2).sum() / (exact**2).sum())
    assert rel <= relative_error_bound(method), (method, rel)


def relative_error_bound(method: str) -> float:
    """Upper bound on the relative squared error of stored keys for Gaussian data.

    These are the bounds stated in docs/reliability.md: the theoretical distortion of each
    codec at its bit width, with room for small head_dims (where a vector norm is only a few
    samples and the coordinate density is far from its large-d limit).
    """
    if method == "dense":
        return 0.0
    bits = int("".join(ch for ch in method if ch.isdigit()) or 8)
    if method.startswith("pqo"):
        b = bits
    elif method.startswith(("pq", "tq")):
        b = bits - 1
    elif method.startswith("int"):
        b = bits
    else:
        return 1.0
    lloyd = {1: 0.3634, 2: 0.1175, 3: 0.0345, 4: 0.0095, 5: 0.0025, 6: 0.0007, 7: 0.0002, 8: 0.00005}
    eps = lloyd[b]
    if method.startswith(("pq", "tq")):
        # unbiased code lengths (the default) leave |x| tan(theta) instead of |x| sin(theta),
        # E tan^2 = eps / (1 - eps); and the query-derived key weights, estimated from a few
        # random queries here, move error between channels: 4x instead of 2x. (The worst cases
        # once found, x3.45 and x4.3 for pqo4 at head_dim 48 and 96, pinned as examples above,
        # were keys drawn from the rotation's own random stream, now kept apart.)
        return 4.0 * eps / (1.0 - eps) + 1e-3
    return 2.0 * eps + 1e-3
