import numpy as np
import pytest

import arraykv

from conftest import asarray, to_np
from naive import attention_loops


@pytest.mark.parametrize(
    "b,hkv,g,t,s,d", [(1, 1, 1, 1, 1, 4), (2, 2, 3, 4, 9, 8), (1, 3, 2, 1, 17, 16), (3, 1, 4, 5, 5, 8)]
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_attention_matches_loops(xp, rng, b, hkv, g, t, s, d, causal, bias):
    q = rng.standard_normal((b, hkv * g, t, d))
    k = rng.standard_normal((b, hkv, s, d))
    v = rng.standard_normal((b, hkv, s, d))
    lb = rng.standard_normal((b, hkv * g, t, s)) if bias else None
    want = attention_loops(q, k, v, 0.37, lb, causal)
    got = arraykv.attention(
        asarray(xp, q),
        asarray(xp, k),
        asarray(xp, v),
        softmax_scale=0.37,
        logit_bias=None if lb is None else asarray(xp, lb),
        causal=causal,
    )
    assert tuple(got.shape) == (b, hkv * g, t, d)
    np.testing.assert_allclose(to_np(got), want, rtol=1e-10, atol=1e-12)


def test_attention_stable_for_huge_logits(xp, rng):
    q = rng.standard_normal((1, 2, 1, 8)) * 1e3
    k = rng.standard_normal((1, 2, 6, 8)) * 1e3
    v = rng.standard_normal((1, 2, 6, 8))
    got = to_np(arraykv.attention(asarray(xp, q), asarray(xp, k), asarray(xp, v), softmax_scale=1.0))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, attention_loops(q, k, v, 1.0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_attention_keeps_dtype(rng, dtype):
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in [(1, 4, 3, 8), (1, 2, 7, 8), (1, 2, 7, 8)])
    out = arraykv.attention(q, k, v, softmax_scale=0.3)
    assert out.dtype == np.dtype(dtype)
    tol = 2e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), attention_loops(q, k, v, 0.3), rtol=tol, atol=tol)


def test_attention_on_strided_cache_view(rng):
    big = rng.standard_normal((1, 2, 50, 8)).astype(np.float32)
    k, v = big[:, :, :20], big[:, :, 20:40]
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    np.testing.assert_allclose(
        arraykv.attention(q, k, v, softmax_scale=0.5), attention_loops(q, k, v, 0.5), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "case,exc",
    [
        (dict(q=(1, 3, 1, 8)), ValueError),  # 3 q heads vs 2 kv heads
        (dict(k=(1, 2, 6, 4)), ValueError),  # head_dim mismatch
        (dict(v=(1, 2, 5, 8)), ValueError),  # k/v token mismatch
        (dict(q=(1, 4, 8, 8)), ValueError),  # more queries than keys
        (dict(q=(4, 8)), ValueError),  # wrong rank
        (dict(k=(2, 2, 6, 8), v=(2, 2, 6, 8)), ValueError),  # batch mismatch
    ],
)
def test_attention_rejects_bad_shapes(rng, case, exc):
    shapes = dict(q=(1, 4, 1, 8), k=(1, 2, 6, 8), v=(1, 2, 6, 8))
    shapes.update(case)
    arrs = {n: rng.standard_normal(s) for n, s in shapes.items()}
    with pytest.raises(exc):
        arraykv.attention(arrs["q"], arrs["k"], arrs["v"], softmax_scale=1.0)
    with pytest.raises(TypeError):
        arraykv.attention(np.ones((1, 2, 1, 8), np.int32), arrs["k"][:1, :2], arrs["v"][:1, :2], softmax_scale=1.0)
