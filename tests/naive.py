"""Slow, obviously correct reference implementations (plain loops over NumPy float64).

Every fast path in the library is compared against these on fresh random inputs.
"""

from __future__ import annotations

import math

import numpy as np


def attention_loops(q, k, v, scale, logit_bias=None, causal=True):
    """Attention one (batch, head, query) at a time.

    q (B, Hq, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) -> (B, Hq, T, Dv), float64.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b, hq, t, d = q.shape
    _, hkv, s, _ = k.shape
    g = hq // hkv
    out = np.zeros((b, hq, t, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            for i in range(t):
                limit = s - t + i if causal else s - 1
                logits = []
                for j in range(limit + 1):
                    x = scale * sum(q[bi, h, i, c] * k[bi, kh, j, c] for c in range(d))
                    if logit_bias is not None:
                        x += float(logit_bias[bi, h, i, j])
                    logits.append(x)
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                z = sum(w)
                for j in range(limit + 1):
                    out[bi, h, i] += (w[j] / z) * v[bi, kh, j]
    return out


def intq_quantize_loops(x, bits, group_size, param_dtype="float32"):
    """Group-wise asymmetric quantization of ``x`` (..., n) along its last axis, one value at a time.

    Straight from the documented layout of ``arraykv.quant.intq``: per group of ``group_size``
    values, ``scale = (max - min) / (2**bits - 1)`` and ``offset = min`` rounded to
    ``param_dtype``, ``code = clip(floor((x - offset) / scale + 1/2), 0, 2**bits - 1)`` (computed
    in float32), and code ``i`` of a row at bits ``[i*bits, (i+1)*bits)`` of a little-endian
    byte stream. Returns ``(codes uint8 (..., ceil(n*bits/8)), scale, offset (..., groups))``.
    """
    x = np.asarray(x, np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n)
    groups = -(-n // group_size)
    levels = 2**bits - 1
    codes = np.zeros((rows.shape[0], (n * bits + 7) // 8), np.uint8)
    scale = np.zeros((rows.shape[0], groups), param_dtype)
    offset = np.zeros((rows.shape[0], groups), param_dtype)
    for r in range(rows.shape[0]):
        for j in range(groups):
            grp = rows[r, j * group_size:(j + 1) * group_size]
            lo, hi = min(grp), max(grp)
            scale[r, j] = np.float32(np.float32(hi - lo) / np.float32(levels))
            offset[r, j] = lo
            s32, o32 = np.float32(scale[r, j]), np.float32(offset[r, j])
            inv = np.float32(0) if s32 == 0 else np.float32(1) / s32
            for i, val in enumerate(grp):
                c = int(min(max(np.floor((val - o32) * inv + np.float32(0.5)), 0), levels))
                pos = (j * group_size + i) * bits
                for bit in range(bits):
                    if c >> bit & 1:
                        codes[r, (pos + bit) // 8] |= np.uint8(1 << ((pos + bit) % 8))
    return (codes.reshape(lead + (codes.shape[-1],)), scale.reshape(lead + (groups,)),
            offset.reshape(lead + (groups,)))


def _code_loops(packed_row, bits, i):
    """Code ``i`` of a packed row (little-endian bit stream), bit by bit."""
    c = 0
    for bit in range(bits):
        pos = i * bits + bit
        c |= ((int(packed_row[pos // 8]) >> (pos % 8)) & 1) << bit
    return c


def int_codec_kv_loops(codec):
    """Keys and values of an ``IntLayerCodec``, one element at a time from its documented formulas.

    Returns float64 ``(k, v)`` of shape (batch, kv_heads, n_tokens, head_dim).
    """
    G, bits, n = codec.group_size, codec.bits, codec.n_tokens
    b, h = codec.v_codes.shape[:2]
    d = codec.k_residual.shape[3]
    nq, nvq = codec.n_groups * G, n - codec.n_window
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    ks, ko, vs, vo = f(codec.k_scale), f(codec.k_offset), f(codec.v_scale), f(codec.v_offset)
    kr = f(codec.k_residual)
    vw = f(codec.v_window) if codec.n_window else None
    k = np.zeros((b, h, n, d))
    v = np.zeros((b, h, n, d))
    for bi in range(b):
        for hi in range(h):
            for t in range(n):
                for c in range(d):
                    if t < nq:
                        grp, i = divmod(t, G)
                        code = _code_loops(codec.k_codes[bi, hi, grp, c], bits, i)
                        k[bi, hi, t, c] = ks[bi, hi, grp, c] * code + ko[bi, hi, grp, c]
                    else:
                        k[bi, hi, t, c] = kr[bi, hi, t - nq, c]
                    if t < nvq:
                        code = _code_loops(codec.v_codes[bi, hi, t], bits, c)
                        v[bi, hi, t, c] = vs[bi, hi, t, c // G] * code + vo[bi, hi, t, c // G]
                    else:
                        v[bi, hi, t, c] = vw[bi, hi, t - nvq, c]
    return k, v


def int_decode_attention_loops(codec, q, scale):
    """Decode attention over an ``IntLayerCodec``: keys and values rebuilt by loops, then attention by loops.

    ``q`` (batch, q_heads, 1, head_dim) -> float64 (batch, q_heads, 1, head_dim).
    """
    k, v = int_codec_kv_loops(codec)
    return attention_loops(q, k, v, scale)
