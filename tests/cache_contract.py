"""Reusable checks of the CompressedKVCache contract, for any cache and namespace."""

from __future__ import annotations

import numpy as np

import arraykv

from conftest import asarray, to_np


def random_kvq(rng, xp, b, hkv, g, t, d, dtype="float32"):
    k = asarray(xp, rng.standard_normal((b, hkv, t, d)).astype(dtype))
    v = asarray(xp, rng.standard_normal((b, hkv, t, d)).astype(dtype))
    q = asarray(xp, rng.standard_normal((b, hkv * g, t, d)).astype(dtype))
    return k, v, q


def rotary_embed(x, theta=10000.0):
    """Rotary embedding (rotate-half pairs ``(j, j + d/2)``, base ``theta``) of NumPy ``x``
    (..., n, d) at positions 0 .. n-1: keys of a rotary model when ``x`` holds a mean plus noise."""
    n, d = x.shape[-2:]
    ang = np.arange(n)[:, None] * theta ** (-2.0 * np.arange(d // 2) / d)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def attend(out, q, scale):
    """Attention output of a decode result (Fused or Dequantized)."""
    if isinstance(out, arraykv.Fused):
        return out.output
    assert isinstance(out, arraykv.Dequantized)
    r = out.result
    return arraykv.attention(q, r.k, r.v, softmax_scale=scale, logit_bias=r.logit_bias)


def snapshot(cache):
    """Everything a cache holds, as NumPy arrays, plus its lengths."""
    return [
        (cache.seq_len(i), {n: to_np(a) for n, a in cache.layer_arrays(i).items()}) for i in range(cache.num_layers)
    ]


def assert_same_snapshot(a, b, *, restored=False):
    """Equal snapshots; with ``restored`` (``a`` continued from a prefix-store entry, which leaves
    out the rollback copies) ``a``'s rollback copies are the last of ``b``'s."""
    assert len(a) == len(b)
    for (la, da), (lb, db) in zip(a, b):
        assert la == lb
        assert sorted(da) == sorted(db)
        for n in da:
            x, y = np.asarray(da[n]), np.asarray(db[n])
            if restored and n in ("k_rollback", "v_rollback"):
                assert x.shape[2] <= y.shape[2], n
                y = y[:, :, y.shape[2] - x.shape[2] :]
            np.testing.assert_array_equal(x, y, err_msg=n)
