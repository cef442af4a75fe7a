"""Slow, obviously correct versions of the library's operations: plain Python loops over every index.

Each function is written from the definition in the docstring of the module it mirrors (named
in its own docstring), one scalar at a time in NumPy float64 unless the definition fixes a
rounding (float16 lengths, float32 integer-quantization parameters). Every fast path of the
library, kernels on and off, is compared against these on fresh random inputs
(``test_naive_oracles.py`` and the module tests).
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
            grp = rows[r, j * group_size : (j + 1) * group_size]
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
    return (codes.reshape(lead + (codes.shape[-1],)), scale.reshape(lead + (groups,)), offset.reshape(lead + (groups,)))


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


# -- bit packing (arraykv.quant.bitpack) ------------------------------------------------------


def pack_bits_loops(codes, bits):
    """Pack ``codes`` (..., n) of ``bits`` bits into a little-endian bit stream per row, bit by bit.

    From the layout of :mod:`arraykv.quant.bitpack`: code ``i`` occupies stream bits
    ``[i*bits, (i+1)*bits)`` (its bit ``k`` at stream bit ``i*bits + k``), stream bit ``j`` is bit
    ``j % 8`` of byte ``j // 8``, a row takes ``ceil(n*bits/8)`` bytes and bits above ``bits`` of
    a code are dropped. Returns uint8 (..., ceil(n*bits/8)).
    """
    codes = np.asarray(codes)
    lead, n = codes.shape[:-1], codes.shape[-1]
    rows = codes.reshape(-1, n)
    out = np.zeros((rows.shape[0], (n * bits + 7) // 8), np.uint8)
    for r in range(rows.shape[0]):
        for i in range(n):
            c = int(rows[r, i])
            for bit in range(bits):
                if c >> bit & 1:
                    pos = i * bits + bit
                    out[r, pos // 8] |= np.uint8(1 << (pos % 8))
    return out.reshape(lead + (out.shape[-1],))


def unpack_bits_loops(packed, bits, n):
    """The ``n`` codes of each row of ``packed`` (..., ceil(n*bits/8)), read bit by bit (uint8 (..., n))."""
    packed = np.asarray(packed)
    lead = packed.shape[:-1]
    rows = packed.reshape(-1, packed.shape[-1])
    out = np.zeros((rows.shape[0], n), np.uint8)
    for r in range(rows.shape[0]):
        for i in range(n):
            out[r, i] = _code_loops(rows[r], bits, i)
    return out.reshape(lead + (n,))


def intq_dequantize_loops(codes, scale, offset, bits, group_size, n):
    """``x̂ = scale · code + offset`` of every value of a group-quantized row (:mod:`arraykv.quant.intq`).

    ``codes`` (..., ceil(n*bits/8)) packed, ``scale``/``offset`` (..., groups); float64 (..., n).
    """
    codes = np.asarray(codes)
    lead = codes.shape[:-1]
    rows = codes.reshape(-1, codes.shape[-1])
    s = np.asarray(scale, np.float64).reshape(rows.shape[0], -1)
    o = np.asarray(offset, np.float64).reshape(rows.shape[0], -1)
    out = np.zeros((rows.shape[0], n))
    for r in range(rows.shape[0]):
        for i in range(n):
            out[r, i] = s[r, i // group_size] * _code_loops(rows[r], bits, i) + o[r, i // group_size]
    return out.reshape(lead + (n,))


# -- TurboQuant-MSE (arraykv.quant.polar) -----------------------------------------------------


def nearest_index_loops(y, levels):
    """Index of the level nearest to the scalar ``y`` (the lower index when two are equally near)."""
    best = 0
    for i in range(len(levels)):
        if abs(y - float(levels[i])) < abs(y - float(levels[best])):
            best = i
    return best


def polar_rotate_loops(x, rotation):
    """``(y, ‖x‖)`` with ``y = M x / ‖x‖`` (0 for a zero vector), ``M = rotation.dense()``, by loops.

    ``x`` (..., d) -> ``y`` float64 (..., d) and ``‖x‖`` float64 (...).
    """
    m = np.asarray(rotation.dense(), np.float64)
    x = np.asarray(x, np.float64)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    y = np.zeros(rows.shape)
    norm = np.zeros(rows.shape[0])
    for r in range(rows.shape[0]):
        norm[r] = math.sqrt(sum(rows[r, c] * rows[r, c] for c in range(d)))
        if norm[r] > 0.0:
            for i in range(d):
                y[r, i] = sum(m[i, c] * rows[r, c] for c in range(d)) / norm[r]
    return y.reshape(lead + (d,)), norm.reshape(lead)


def polar_encode_loops(x, codebook, rotation, length="fit"):
    """TurboQuant-MSE codes of ``x`` (..., d), from the definitions of :mod:`arraykv.quant.polar`.

    ``y = M x / ‖x‖``; each coordinate's code is its nearest centroid ``ŷ_i = c[code_i]``; the
    stored length is ``‖x‖ ⟨y, ŷ⟩ / ‖ŷ‖²`` (``"fit"``) or ``‖x‖ / ⟨y, ŷ⟩`` (``"unbiased"``, 0
    where ``⟨y, ŷ⟩ <= 0``), rounded to float16. Returns ``(codes uint8 (..., d) unpacked,
    lengths float16 (...))``.
    """
    cent = np.asarray(codebook.centroids, np.float64)
    y, norm = polar_rotate_loops(x, rotation)
    lead, d = y.shape[:-1], y.shape[-1]
    ys = y.reshape(-1, d)
    ns = norm.reshape(-1)
    codes = np.zeros(ys.shape, np.uint8)
    lengths = np.zeros(ys.shape[0], np.float16)
    for r in range(ys.shape[0]):
        dot = 0.0
        sq = 0.0
        for i in range(d):
            codes[r, i] = nearest_index_loops(ys[r, i], cent)
            yh = cent[codes[r, i]]
            dot += ys[r, i] * yh
            sq += yh * yh
        if length == "fit":
            n = ns[r] * dot / sq
        else:
            n = ns[r] / dot if dot > 0.0 else 0.0
        lengths[r] = np.float16(n)
    return codes.reshape(lead + (d,)), lengths.reshape(lead)


def polar_decode_loops(packed, lengths, codebook, rotation):
    """``x̂ = n · Mᵀ c[codes]`` (:mod:`arraykv.quant.polar`) of packed codes (..., ceil(d*bits/8)).

    Returns float64 (..., d).
    """
    m = np.asarray(rotation.dense(), np.float64)
    cent = np.asarray(codebook.centroids, np.float64)
    d = m.shape[0]
    packed = np.asarray(packed)
    lead = packed.shape[:-1]
    rows = packed.reshape(-1, packed.shape[-1])
    ns = np.asarray(lengths, np.float64).reshape(-1)
    out = np.zeros((rows.shape[0], d))
    for r in range(rows.shape[0]):
        yh = [cent[_code_loops(rows[r], codebook.bits, i)] for i in range(d)]
        for c in range(d):
            out[r, c] = ns[r] * sum(m[i, c] * yh[i] for i in range(d))
    return out.reshape(lead + (d,))


# -- product quantization (arraykv.quant.vq) --------------------------------------------------


def pq_code_bits(codebook_size):
    """Bits of one product-quantization code: ``max(1, ceil(log2(codebook_size)))``."""
    return max(1, math.ceil(math.log2(codebook_size)))


def pq_assign_loops(x, centroids):
    """Nearest centroid of every sub-vector, by squared distance (the lower index on ties).

    ``x`` (..., h, t, d), ``centroids`` (h, m, K, s) with ``m * s == d``: sub-vector ``j`` of a
    vector is channels ``[j*s, (j+1)*s)`` and is matched against ``centroids[head, j]``.
    Returns ``(index int64 (..., h, t, m), squared distances float64 (..., h, t, m, K))``.
    """
    x = np.asarray(x, np.float64)
    c = np.asarray(centroids, np.float64)
    h, m, k, s = c.shape
    lead = x.shape[:-3]
    t = x.shape[-2]
    xs = x.reshape((-1, h, t, m * s))
    idx = np.zeros(xs.shape[:3] + (m,), np.int64)
    dist = np.zeros(xs.shape[:3] + (m, k))
    for r in range(xs.shape[0]):
        for hi in range(h):
            for ti in range(t):
                for j in range(m):
                    for ci in range(k):
                        dist[r, hi, ti, j, ci] = sum(
                            (xs[r, hi, ti, j * s + e] - c[hi, j, ci, e]) ** 2 for e in range(s)
                        )
                    idx[r, hi, ti, j] = nearest_index_loops(0.0, list(dist[r, hi, ti, j]))
    return idx.reshape(lead + (h, t, m)), dist.reshape(lead + (h, t, m, k))


def pq_encode_loops(x, centroids):
    """Product-quantization codes as :class:`arraykv.quant.vq.VQCodes` stores them.

    The indices of :func:`pq_assign_loops`, packed with :func:`pack_bits_loops` at
    ``pq_code_bits(K)`` bits when that is at most 8, else one uint16 per code.
    """
    idx, _ = pq_assign_loops(x, centroids)
    bits = pq_code_bits(np.shape(centroids)[2])
    if bits <= 8:
        return pack_bits_loops(idx.astype(np.uint8), bits)
    return idx.astype(np.uint16)


def pq_decode_loops(codes, centroids, bits):
    """The concatenated centroids that ``codes`` (..., h, t, width) name: float64 (..., h, t, m*s)."""
    c = np.asarray(centroids, np.float64)
    h, m, _, s = c.shape
    codes = np.asarray(codes)
    lead, t = codes.shape[:-3], codes.shape[-2]
    rows = codes.reshape((-1, h, t, codes.shape[-1]))
    out = np.zeros(rows.shape[:3] + (m * s,))
    for r in range(rows.shape[0]):
        for hi in range(h):
            for ti in range(t):
                for j in range(m):
                    a = int(rows[r, hi, ti, j]) if bits > 8 else _code_loops(rows[r, hi, ti], bits, j)
                    for e in range(s):
                        out[r, hi, ti, j * s + e] = c[hi, j, a, e]
    return out.reshape(lead + (h, t, m * s))


# -- dense-and-sparse split (arraykv.quant.outliers) -----------------------------------------


def split_outliers_loops(x, threshold):
    """Outliers of ``x`` (b, h, n, d) by the rule of :mod:`arraykv.quant.outliers`, one value at a time.

    Per (head, channel), over every token of every batch row: ``μ`` the mean and ``σ`` the
    (population) standard deviation; ``x`` is an outlier when ``|x − μ| > threshold · σ``.
    Returns ``(dense float64 with outliers replaced by μ, flat C-order index int64 ascending,
    values in the dtype of x, margin float64 = |x − μ| − threshold · σ of every value)``.
    """
    x = np.asarray(x)
    xf = x.astype(np.float64)
    b, h, n, d = x.shape
    dense = xf.copy()
    margin = np.zeros(x.shape)
    for hi in range(h):
        for c in range(d):
            vals = [xf[bi, hi, t, c] for bi in range(b) for t in range(n)]
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((a - mu) ** 2 for a in vals) / len(vals))
            for bi in range(b):
                for t in range(n):
                    margin[bi, hi, t, c] = abs(xf[bi, hi, t, c] - mu) - threshold * sd
                    if margin[bi, hi, t, c] > 0.0:
                        dense[bi, hi, t, c] = mu
    index, value = [], []
    flat = 0
    for bi in range(b):
        for hi in range(h):
            for t in range(n):
                for c in range(d):
                    if margin[bi, hi, t, c] > 0.0:
                        index.append(flat)
                        value.append(x[bi, hi, t, c])
                    flat += 1
    return dense, np.asarray(index, np.int64), np.asarray(value, x.dtype), margin


# -- polar caches (arraykv.caches.polar_codec) -----------------------------------------------


def rotary_mean_loops(mu, freq, pairs, p):
    """The key mean at position ``p`` of one head (:mod:`arraykv.quant.rotary_mean`).

    ``mu`` (d,), ``freq`` (d // 2,), ``pairs`` (d // 2, 2): in pair ``j`` = channels ``(a, b)``
    with ``φ = freq[j] · p``, ``m[a] = μ_a cos φ − μ_b sin φ`` and ``m[b] = μ_b cos φ + μ_a sin φ``;
    a channel outside every pair keeps ``μ``. float64 (d,).
    """
    mu = [float(a) for a in mu]
    m = list(mu)
    for j in range(len(pairs)):
        a, b = int(pairs[j][0]), int(pairs[j][1])
        phi = float(freq[j]) * p
        m[a] = mu[a] * math.cos(phi) - mu[b] * math.sin(phi)
        m[b] = mu[b] * math.cos(phi) + mu[a] * math.sin(phi)
    return np.asarray(m)


def polar_codec_kv_loops(codec):
    """Keys and values of a ``PolarLayerCodec``, token by token from its documented decoding.

    A quantized token ``t`` of head ``(b, h)``: ``k = n_t · Mᵀ c[codes_t]`` (the rotation part),
    then the outlier channels ``k[k_outlier_idx[j]] = k_outliers[t, j]``, then
    ``k = k / k_scale + m_t`` with ``m_t`` the key mean at position ``n_sink + t`` (``k_mean``,
    or with ``k_mean_freq`` the rotating mean of :func:`rotary_mean_loops`); values
    ``v = n_t · Mᵀ c[codes_t] + v_mean``. A missing mean is zero and a missing ``k_scale`` one.
    Token order: the sinks ``k_window[:, :, :n_sink]``, the quantized tokens, then
    ``k_window[:, :, n_sink:]``. Returns float64 ``(k, v)`` (batch, kv_heads, tokens, d).
    """
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    m = np.asarray(codec.rotation.dense(), np.float64)
    kc, vc = f(codec.k_codebook.centroids), f(codec.v_codebook.centroids)
    kw, vw = f(codec.k_window), f(codec.v_window)
    b, h, _, d = kw.shape
    ns, nq = codec.n_sink, codec.n_quantized
    total = codec.n_window + nq
    k_norms, v_norms = f(codec.k_norms), f(codec.v_norms)
    k_scale, k_mean, v_mean = f(codec.k_scale), f(codec.k_mean), f(codec.v_mean)
    k_out = f(codec.k_outliers)
    out_idx = None if codec.k_outlier_idx is None else np.asarray(codec.k_outlier_idx)
    k = np.zeros((b, h, total, d))
    v = np.zeros((b, h, total, d))

    def rotated_part(codes_row, bits, centroids, n):
        yh = [centroids[_code_loops(codes_row, bits, i)] for i in range(d)]
        return [n * sum(m[i, c] * yh[i] for i in range(d)) for c in range(d)]

    for bi in range(b):
        for hi in range(h):
            for t in range(total):
                if t < ns or t >= ns + nq:  # exact tokens: sinks, then the recent window
                    w = t if t < ns else t - nq
                    k[bi, hi, t] = kw[bi, hi, w]
                    v[bi, hi, t] = vw[bi, hi, w]
                    continue
                tq = t - ns
                kk = rotated_part(codec.k_codes[bi, hi, tq], codec.k_codebook.bits, kc, k_norms[bi, hi, tq])
                if out_idx is not None:
                    for j in range(out_idx.shape[-1]):
                        kk[int(out_idx[bi, hi, j])] = k_out[bi, hi, tq, j]
                if k_mean is None:
                    mt = [0.0] * d
                elif codec.k_mean_freq is None:
                    mt = list(k_mean[bi, hi])
                else:
                    mt = list(
                        rotary_mean_loops(
                            k_mean[bi, hi],
                            np.asarray(codec.k_mean_freq)[bi, hi],
                            np.asarray(codec.k_mean_pairs),
                            ns + tq,
                        )
                    )
                for c in range(d):
                    s = 1.0 if k_scale is None else k_scale[bi, hi, c]
                    k[bi, hi, t, c] = kk[c] / s + mt[c]
                vv = rotated_part(codec.v_codes[bi, hi, tq], codec.v_codebook.bits, vc, v_norms[bi, hi, tq])
                for c in range(d):
                    v[bi, hi, t, c] = vv[c] + (0.0 if v_mean is None else v_mean[bi, hi, c])
    return k, v


def polar_qjl_bias_loops(codec, q, scale):
    """The QJL logit term of a ``tq`` layer, (batch, q_heads, 1, tokens) float64, token order of the codec.

    For quantized token ``t`` the logit of query ``q`` gains
    ``scale · √(π/2)/m · k_qjl_norms[t] · ⟨S q̃, ±1(k_qjl[t])⟩``, where ``q̃`` is the query in
    the space the residual was sketched in: divided by ``k_scale`` (keys are encoded as
    ``s ⊙ (k − m_t)``) with the outlier channels zeroed (the residual excludes them). Exact
    tokens gain nothing.
    """
    q = np.asarray(q, np.float64)
    sk = np.asarray(codec.qjl.matrix, np.float64)
    rows, d = sk.shape
    b, hq = q.shape[:2]
    h = codec.k_window.shape[1]
    g = hq // h
    ns, nq = codec.n_sink, codec.n_quantized
    total = codec.n_window + nq
    k_scale = None if codec.k_scale is None else np.asarray(codec.k_scale, np.float64)
    out_idx = None if codec.k_outlier_idx is None else np.asarray(codec.k_outlier_idx)
    norms = np.asarray(codec.k_qjl_norms, np.float64)
    bias = np.zeros((b, hq, 1, total))
    for bi in range(b):
        for qi in range(hq):
            hi = qi // g
            qt = [q[bi, qi, 0, c] / (1.0 if k_scale is None else k_scale[bi, hi, c]) for c in range(d)]
            if out_idx is not None:
                for j in range(out_idx.shape[-1]):
                    qt[int(out_idx[bi, hi, j])] = 0.0
            sq = [sum(sk[i, c] * qt[c] for c in range(d)) for i in range(rows)]
            for tq in range(nq):
                signs = [2.0 * _code_loops(codec.k_qjl[bi, hi, tq], 1, i) - 1.0 for i in range(rows)]
                dot = sum(sq[i] * signs[i] for i in range(rows))
                bias[bi, qi, 0, ns + tq] = scale * math.sqrt(math.pi / 2.0) / rows * norms[bi, hi, tq] * dot
    return bias


def polar_decode_attention_loops(codec, q, scale):
    """Decode attention over a ``PolarLayerCodec``: K/V (and the QJL term) by loops, then attention by loops.

    ``q`` (batch, q_heads, 1, d) -> float64 (batch, q_heads, 1, d).
    """
    k, v = polar_codec_kv_loops(codec)
    bias = polar_qjl_bias_loops(codec, q, scale) if codec.qjl is not None and codec.k_qjl is not None else None
    return attention_loops(q, k, v, scale, logit_bias=bias, causal=False)


# -- vq and lowrank caches ---------------------------------------------------------------------


def pq_decode_attention_loops(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, *, bits, softmax_scale):
    """One decode step over product-quantized keys/values plus dense tokens (``pq_decode_attention_reference``).

    Keys and values of the coded tokens are their concatenated centroids
    (:func:`pq_decode_loops`), followed by the exact ``k_extra``/``v_extra`` tokens; every token
    is visible. ``q`` (batch, q_heads, d) -> float64 (batch, q_heads, d).
    """
    k = pq_decode_loops(k_codes, k_centroids, bits)
    v = pq_decode_loops(v_codes, v_centroids, bits)
    k = np.concatenate([k, np.asarray(k_extra, np.float64)], axis=2)
    v = np.concatenate([v, np.asarray(v_extra, np.float64)], axis=2)
    return attention_loops(np.asarray(q)[:, :, None, :], k, v, softmax_scale, causal=False)[:, :, 0, :]


def lowrank_decode_attention_loops(
    q, k_coef, k_basis, k_mean, v_coef, v_basis, v_mean, k_extra, v_extra, *, softmax_scale
):
    """One decode step over a low-rank layer (:mod:`arraykv.attention.lowrank_fused`), by loops.

    Encoded token ``t`` of head ``h`` is ``x = μ[h] + B[h] c_t`` (keys and values alike),
    followed by the exact ``k_extra``/``v_extra`` tokens; every token is visible.
    ``q`` (batch, q_heads, 1, d) -> float64 (batch, q_heads, 1, d).
    """

    def rebuild(coef, basis, mean):
        coef = np.asarray(coef, np.float64)
        b, h, t, r = coef.shape
        d = 0 if basis is None else np.shape(basis)[1]
        x = np.zeros((b, h, t, d))
        if t:
            basis, mean = np.asarray(basis, np.float64), np.asarray(mean, np.float64)
            for bi in range(b):
                for hi in range(h):
                    for ti in range(t):
                        for c in range(d):
                            x[bi, hi, ti, c] = mean[hi, c] + sum(
                                basis[hi, c, j] * coef[bi, hi, ti, j] for j in range(r)
                            )
        return x

    k_extra, v_extra = np.asarray(k_extra, np.float64), np.asarray(v_extra, np.float64)
    k, v = rebuild(k_coef, k_basis, k_mean), rebuild(v_coef, v_basis, v_mean)
    if k.shape[2]:
        k, v = np.concatenate([k, k_extra], axis=2), np.concatenate([v, v_extra], axis=2)
    else:
        k, v = k_extra, v_extra
    return attention_loops(q, k, v, softmax_scale, causal=False)
