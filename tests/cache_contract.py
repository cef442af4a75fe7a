"""Reusable checks of the CompressedKVCache contract, for any cache and namespace."""

from __future__ import annotations

import numpy as np

import arraykv
from arraykv.store.entry import ROLLBACK_ARRAYS

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


def restored_counterpart(name, x, y, restored):
    """The part of ``b``'s array ``y`` that ``a``'s array ``x`` must equal: all of it, or, with
    ``restored`` (``a`` continued from a prefix-store entry, which leaves out the rollback
    copies), for the rollback copies the last ``x.shape[2]`` of ``y``'s."""
    if restored and name in ROLLBACK_ARRAYS:
        assert x.shape[2] <= y.shape[2], name
        return y[:, :, y.shape[2] - x.shape[2] :]
    return y


def assert_same_snapshot(a, b, *, restored=False):
    """Equal snapshots (:func:`snapshot`); ``restored``: see :func:`restored_counterpart`."""
    assert len(a) == len(b)
    for (la, da), (lb, db) in zip(a, b):
        assert la == lb
        assert sorted(da) == sorted(db)
        for n in da:
            x = np.asarray(da[n])
            np.testing.assert_array_equal(x, restored_counterpart(n, x, np.asarray(db[n]), restored), err_msg=n)


def assert_same_state(a, b, *, restored=False):
    """Every saved array of cache ``a`` (``snapshot(host=True)``: per layer its length, dtype and
    arrays) equals ``b``'s, dtype included; ``restored``: see :func:`restored_counterpart`."""
    ra, rb = a.snapshot(host=True), b.snapshot(host=True)
    assert len(ra) == len(rb)
    for la, lb in zip(ra, rb):
        assert (la is None) == (lb is None)
        if la is None:
            continue
        assert (la.length, la.dtype) == (lb.length, lb.dtype) and la.arrays.keys() == lb.arrays.keys()
        for name in la.arrays:
            x = np.asarray(la.arrays[name])
            y = restored_counterpart(name, x, np.asarray(lb.arrays[name]), restored)
            assert x.dtype == y.dtype and np.array_equal(x, y), name
