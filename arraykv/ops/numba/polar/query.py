"""The per-head parts of the fused PolarQuant kernel outside its token loop (Numba): one KV head's GQA group.

:func:`prepare_head` gives the scaled, rotated queries, their outlier channels, the key-mean
constant and the QJL sketch of the queries; :func:`prepare_rotating` the coefficients and
phase tables of a rotating (RoPE-aware) key mean (see
:func:`arraykv.attention.polar_fused.prepare_queries` for the math). :func:`finish_head` merges
the token splits with the float16 window and rotates the value sum back
(:func:`arraykv.attention.polar_fused.merge_window`).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from ....quant.qjl import QJL_SCALE
from ..fused_driver import FASTMATH, TILE, merge_splits, merge_top
from ..half import half_to_float
from ..planar import planar_to_channels
from .codec import fwht

__all__ = ["prepare_head", "prepare_rotating", "finish_head"]


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def prepare_rotating(q, b, h, scale, k_mean, rm_freq, rm_pairs, half, qconst, ra, rb, rw, ct, st, step):
    """The turning pairs of a rotating key mean of KV head ``(b, h)``; returns their count ``J``.

    For pair ``j`` (channels ``a, c``) with ``ω ≠ 0``: ``ra[g, j] = scale (q_a μ_a + q_c μ_c)``
    and ``rb[g, j] = scale (q_c μ_a − q_a μ_c)``, so that its share of ``scale · q·m_p`` is
    ``ra cos ωp + rb sin ωp``; that share is taken out of ``qconst``. ``rw[j] = ω``,
    ``ct[r, j], st[r, j] = cos, sin(ω r)`` for ``r < TILE`` and ``step[j] = (cos, sin)(ω TILE)``.
    """
    g_n = ra.shape[0]
    sc = np.float32(scale)
    n_j = 0
    for j in range(rm_pairs.shape[0]):
        w = np.float64(rm_freq[b, h, j])
        if w == 0.0:
            continue
        a = rm_pairs[j, 0]
        c = rm_pairs[j, 1]
        mua = half_to_float(k_mean[b, h, a], half)
        muc = half_to_float(k_mean[b, h, c], half)
        for g in range(g_n):
            qa = q[b, h * g_n + g, a]
            qc = q[b, h * g_n + g, c]
            cos_part = (qa * mua + qc * muc) * sc
            ra[g, n_j] = cos_part
            rb[g, n_j] = (qc * mua - qa * muc) * sc
            qconst[g] -= cos_part
        rw[n_j] = w
        n_j += 1
    # cos, sin(ω r) by one rotation per step, the pairs side by side (their chains are independent)
    c1 = np.empty(n_j, np.float64)
    s1 = np.empty(n_j, np.float64)
    for j in range(n_j):
        c1[j] = math.cos(rw[j])
        s1[j] = math.sin(rw[j])
        step[j, 0] = 1.0  # the running (cos, sin) of ω r
        step[j, 1] = 0.0
    for r in range(TILE):  # after the last step, step[j] is (cos, sin)(ω TILE)
        for j in range(n_j):
            cr = step[j, 0]
            sr = step[j, 1]
            ct[r, j] = np.float32(cr)
            st[r, j] = np.float32(sr)
            step[j, 0] = cr * c1[j] - sr * s1[j]
            step[j, 1] = sr * c1[j] + cr * s1[j]
    return n_j


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def prepare_head(q, b, h, scale, k_scale, k_mean, k_idx, signs, rot, sketch_t, half, x, qr, qout, qconst, sq):
    """Query-side quantities of the ``G`` query heads of KV head ``(b, h)``.

    Writes ``qr`` (G, d) ``scale · M q̃``, ``qout`` (G, n_out) ``scale · (q/s)`` at the outlier
    channels, ``qconst`` (G,) ``scale · q·k_mean`` and ``sq`` (G, m)
    ``scale · √(π/2)/m · S q̃``, where ``q̃`` is ``q / s`` with the outlier channels zeroed
    (see :func:`arraykv.attention.polar_fused.prepare_queries`); ``sketch_t`` is ``Sᵀ`` (d, m), so
    that ``S q̃`` is a sum of its rows (whole vectors, no reduction per row). ``x`` (d,) is scratch.
    A rotating key mean adjusts ``qconst`` afterwards (:func:`prepare_rotating`).
    """
    g_n, d = qr.shape
    n_out = k_idx.shape[2]
    m_rows = sketch_t.shape[1]
    has_scale = k_scale.shape[2] > 0
    has_mean = k_mean.shape[2] > 0
    dense = rot.shape[0] > 0
    c_rot = np.float32(scale / math.sqrt(d))
    c_qjl = np.float32(scale * QJL_SCALE / m_rows) if m_rows else np.float32(0.0)
    sc = np.float32(scale)
    for g in range(g_n):
        qi = h * g_n + g
        acc = np.float32(0.0)
        for j in range(d):
            v = q[b, qi, j]
            if has_mean:
                acc += v * half_to_float(k_mean[b, h, j], half)
            x[j] = v / half_to_float(k_scale[b, h, j], half) if has_scale else v
        qconst[g] = acc * sc
        for o in range(n_out):
            qout[g, o] = x[k_idx[b, h, o]] * sc
        for o in range(n_out):
            x[k_idx[b, h, o]] = np.float32(0.0)
        sg = sq[g]
        for r in range(m_rows):
            sg[r] = np.float32(0.0)
        for j in range(d if m_rows else 0):
            xj = x[j] * c_qjl
            for r in range(m_rows):
                sg[r] += sketch_t[j, r] * xj
        if dense:
            for i in range(d):
                acc = np.float32(0.0)
                for j in range(d):
                    acc += rot[i, j] * x[j]
                qr[g, i] = acc * sc
        else:
            for j in range(d):
                x[j] *= signs[j]
            fwht(x)
            for j in range(d):
                qr[g, j] = x[j] * c_rot


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def finish_head(q, b, h, scale, m_sp, l_sp, acc_sp, n_window, k_window, v_window, v_mean, signs, rot, half, v_per, out):
    """Merge the token splits of head ``(b, h)`` with its float16 window; write ``out[b, qh]``.

    ``m_sp``, ``l_sp`` (splits, G) and ``acc_sp`` (splits, G, d) are :func:`_attend_span`'s
    state per split. The window block (sinks and recent tokens, any order) is attended with the
    unweighted queries; the value sum of the quantized tokens is rotated back (``Mᵀ y``) and
    gains ``l · v_mean`` (see :func:`arraykv.attention.polar_fused.merge_window`). With
    ``v_per`` not 0 the splits' value sums are in planar order (:mod:`arraykv.ops.numba.planar`).
    """
    splits, g_n, d = acc_sp.shape
    has_vmean = v_mean.shape[2] > 0
    dense = rot.shape[0] > 0
    sc = np.float32(scale)
    c_rot = np.float32(1.0 / math.sqrt(d))
    top = np.empty(g_n, np.float32)
    den = np.empty(g_n, np.float32)
    num = np.zeros((g_n, d), np.float32)
    y = np.empty(d, np.float32)
    row = np.empty(d, np.float32)
    sw = np.empty((g_n, n_window), np.float32)
    for g in range(g_n):
        top[g] = merge_top(m_sp, g)
    # window scores, each key row converted once for the group
    for w in range(n_window):
        for j in range(d):
            row[j] = half_to_float(k_window[b, h, w, j], half)
        for g in range(g_n):
            qi = h * g_n + g
            dot = np.float32(0.0)
            for j in range(d):
                dot += q[b, qi, j] * row[j]
            dot *= sc
            sw[g, w] = dot
            if dot > top[g]:
                top[g] = dot
    # quantized tokens: rescaled split sums, back from the rotated domain
    for g in range(g_n):
        for j in range(d):
            y[j] = np.float32(0.0)
        lq = merge_splits(m_sp, l_sp, acc_sp, g, top[g], y)
        if lq > 0:
            if v_per:  # back from planar order
                planar_to_channels(y, v_per, row)
                for j in range(d):
                    y[j] = row[j]
            if dense:
                for i in range(d):
                    yi = y[i]
                    for j in range(d):
                        num[g, j] += yi * rot[i, j]
            else:
                fwht(y)
                for j in range(d):
                    num[g, j] = y[j] * signs[j] * c_rot
            if has_vmean:
                for j in range(d):
                    num[g, j] += lq * half_to_float(v_mean[b, h, j], half)
        den[g] = lq
    # window values, each row converted once for the group
    for w in range(n_window):
        for j in range(d):
            row[j] = half_to_float(v_window[b, h, w, j], half)
        for g in range(g_n):
            p = np.float32(math.exp(sw[g, w] - top[g]))
            den[g] += p
            for j in range(d):
                num[g, j] += p * row[j]
    for g in range(g_n):
        inv = np.float32(1.0) / den[g]
        qi = h * g_n + g
        for j in range(d):
            out[b, qi, j] = num[g, j] * inv
