"""Numba kernel: one decode step of attention straight from an ``int2``/``int4``/``int8`` cache layer.

A call is one compiled function that does the whole step for every (batch, KV head), over the
layout of :class:`arraykv.caches.intq.IntLayerCodec` (keys quantized per channel in groups of
``G`` tokens, then exact residual keys; values quantized per token in groups of ``G`` channels,
then exact window values):

1. the queries of the KV head's GQA group, times the softmax scale;
2. tokens in tiles of whole key groups (about :data:`TILE` tokens): for each key group the
   codes are unpacked once (INT4/INT2 through a byte table: 8-byte loads and stores of two
   codes) into a ``(head_dim, G)`` block, the group's per-channel scales are folded into each
   query head's query and its offsets into a constant, and the block's scores are query ·
   block; residual keys are scored exactly. An online softmax per query head is rescaled once
   per tile, then the tile's value codes are unpacked once for the group and accumulated with
   weights ``p_t · vscale_{t,j}`` per value group ``j``, the offsets as ``Σ_t p_t ·
   voffset_{t,j}`` (exact window values enter the tile with scale 1 and offset 0);
3. a log-sum-exp merge of the token splits and the division by the softmax denominator.

With AVX-512, ``G`` a multiple of 32 and ``head_dim`` a multiple of 64
(:mod:`arraykv.ops.numba.ir_codes`; int2 through :mod:`arraykv.ops.numba.simd_int2`, in channel
order), step 2 runs in 16-lane vectors: a key group is scored with
its tokens along the lanes (each channel's codes converted once for four query heads, no sum
across lanes), the softmax of a tile for every query head at once, and the value codes are
read as their own values (int4 in planar order, the value sums permuted back at the span's
end), each 16-channel chunk times its value group's scale.

Small steps run on the calling thread (:mod:`arraykv.ops.numba.threads`: below
``PARALLEL_MIN_WORK`` values, ``batch · heads · tokens · head_dim``); larger ones split each
head's tokens, at key-group boundaries, over Numba's threads (only step 2 is parallel). Work
buffers are ``O(heads · G_q · head_dim)`` plus ``O(TILE · head_dim + head_dim · G)`` per task:
nothing grows with the context. float16 scales and offsets are read through ``uint16`` views
and :data:`arraykv.ops.numba.half.HALF_TO_FLOAT`. Functions are compiled per parameter
dtype (float16 or float32) and head_dim (64 and 128 fixed at compile time, others read at run
time), for read-only arguments of any layout, when a call first needs them, and cached on disk."""

from __future__ import annotations

from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba import types as nbt
from numba.extending import overload

from ...attention.int_fused import check_query
from .cpu_features import VECTOR_TILES
from .fused_driver import (
    FASTMATH,
    TILE,
    Step,
    alloc_queries,
    build_steps,
    merge_splits,
    merge_top,
    plan,
    prepare_queries,
    ro,
    run_step,
    softmax_tile,
)
from .half import HALF_TO_FLOAT
from .ir_codes import int4_group_scores, int8_group_scores, tile_values_codes_4_scaled, tile_values_codes_8_scaled
from .ir_softmax import softmax_rows
from .planar import channels_to_planar, planar_to_channels, table16
from .simd_int2 import int2_group_scores, tile_values_codes_2_scaled

__all__ = ["int_decode_attention", "TILE"]

#: Byte -> its two 4-bit codes as float32 (low nibble first), as one 8-byte word.
_NIBBLES = (
    np.ascontiguousarray(np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=1).astype(np.float32))
    .view(np.uint64)
    .reshape(-1)
)
#: Byte -> its four 2-bit codes as float32 (lowest bits first), as two 8-byte words (entries 2·byte, 2·byte + 1).
_QUADS = (
    np.ascontiguousarray(np.stack([(np.arange(256) >> s) & 3 for s in (0, 2, 4, 6)], axis=1).astype(np.float32))
    .view(np.uint64)
    .reshape(-1)
)


#: The codes 0..15 as float32: the register table that turns int4 codes into their values.
_CODES16 = table16(np.arange(16, dtype=np.float32))


def _f32(x, half):  # pragma: no cover - replaced in compiled code by the overload below
    raise NotImplementedError


@overload(_f32, inline="always")
def _f32_impl(x, half):
    """A scale/offset element as float32: float16 bit patterns through the table ``half`` (per-token
    and per-group reads in the token loops, where table loads measured faster than F16C
    conversions), floats as they are."""
    if isinstance(x, nbt.Integer):
        return lambda x, half: half[x]
    return lambda x, half: np.float32(x)


class IntArgs(NamedTuple):
    """The arrays and scalars of one step of the integer kernel (``args`` of its functions).

    Scales and offsets are float16 (as ``uint16`` bit patterns) or float32, one dtype for all four.
    """

    #: tokens per key group ``G``
    group_size: int
    #: code width: 2, 4 or 8
    bits: int
    #: uint8 (b, h, n_groups, d, ceil(G · bits / 8)): key codes, one packed row per channel and group
    k_codes: Any
    #: (b, h, n_groups, d): key scales per group and channel
    k_scale: Any
    #: (b, h, n_groups, d): key offsets per group and channel
    k_offset: Any
    #: float32 (b, h, n_res, d), C-contiguous: exact keys after the last whole group
    k_res: Any
    #: uint8 (b, h, n_vq, ceil(d · bits / 8)): value codes, one packed row per token
    v_codes: Any
    #: (b, h, n_vq, d // G): value scales per token and channel group
    v_scale: Any
    #: (b, h, n_vq, d // G): value offsets per token and channel group
    v_offset: Any
    #: float32 (b, h, n_window, d), C-contiguous: exact values after the quantized ones
    v_win: Any
    #: uint64: byte -> codes as float32 words (:data:`_NIBBLES` for 4 bits, :data:`_QUADS` for 2)
    table: Any
    #: float32 (65536,): float16 bit pattern -> value (:data:`arraykv.ops.numba.half.HALF_TO_FLOAT`)
    half: Any


def _signature(param):
    """``(q, scale, n, h_n, args, splits, out)`` with ``args`` the fields of :class:`IntArgs`, float16
    (``uint16``) or float32 scales and offsets."""
    args = nbt.Tuple(
        (
            nbt.int64,
            nbt.int64,
            ro(nbt.uint8, 5),
            ro(param, 4),
            ro(param, 4),
            ro(nbt.float32, 4, "C"),
            ro(nbt.uint8, 4),
            ro(param, 4),
            ro(param, 4),
            ro(nbt.float32, 4, "C"),
            ro(nbt.uint64, 1, "C"),
            ro(nbt.float32, 1, "C"),
        )
    )
    return nbt.void(
        ro(nbt.float32, 3, "C"), nbt.float64, nbt.int64, nbt.int64, args, nbt.int64, nbt.Array(nbt.float32, 3, "C")
    )


_SIGS = [_signature(nbt.uint16), _signature(nbt.float32)]
#: head_dim as a compile-time constant in the steps built for it (``build_steps(dims=...)``); 0: any
_D = 0


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _attend_span(
    b,
    h,
    t_lo,
    t_hi,
    qs,
    args,
    m,
    l,
    acc,
):
    """Online softmax over tokens ``[t_lo, t_hi)`` of head ``(b, h)`` for every query head of its group.

    ``qs`` (G_q, d) are the queries times the softmax scale; ``args`` the step's
    :class:`IntArgs`; ``t_lo`` is a multiple of ``G``.
    ``m``, ``l`` (G_q,) and ``acc`` (G_q, d) hold the running maximum logit, the sum of
    ``exp(logit − m)`` and ``Σ exp(logit − m) · v_t``; they are updated in place (a caller
    starts them at ``-inf``, ``0``, ``0``). Tokens below ``n_groups · G`` have quantized keys,
    the others are rows of ``k_res``; values likewise below ``v_codes.shape[2]``, then ``v_win``.
    ``tab`` is :data:`_NIBBLES` (4 bits) or :data:`_QUADS` (2 bits; 8 bits do not use it).
    """
    G, bits, k_codes, k_scale, k_offset = args.group_size, args.bits, args.k_codes, args.k_scale, args.k_offset
    k_res, v_codes, v_scale, v_offset, v_win = args.k_res, args.v_codes, args.v_scale, args.v_offset, args.v_win
    tab, half = args.table, args.half
    g_n = qs.shape[0]
    d = _D if _D else qs.shape[1]
    n_groups = k_codes.shape[2]
    nq = n_groups * G
    nvq = v_codes.shape[2]
    nvg = v_scale.shape[3]
    tile = max(1, TILE // G) * G
    # row widths in 8-byte words (two float32 codes each), rounded to whole bytes of codes
    kb64 = np.empty((d, 2 * ((G + 3) // 4)), np.uint64)  # one key group, channels x tokens
    kb = kb64.view(np.float32)
    vb64 = np.empty((tile, 2 * ((d + 3) // 4)), np.uint64)  # the tile's values, tokens x channels
    vb = vb64.view(np.float32)
    s = np.empty((g_n, tile), np.float32)
    ksf = np.empty(d, np.float32)
    kof = np.empty(d, np.float32)
    vsf = np.empty((nvg, tile), np.float32)
    vof = np.empty((nvg, tile), np.float32)
    wt = np.empty(tile, np.float32)
    ebits = np.empty(tile, np.int32)
    d4 = d - d % 4
    nbk = (G * bits + 7) // 8  # bytes per packed key row / value row
    nbv = (d * bits + 7) // 8
    # int2/int4/int8 in 16-lane vectors: key groups scored with tokens along the lanes, values summed
    # from the packed rows (int4 in planar order: even channels, then odd; :mod:`arraykv.ops.numba.planar`)
    vec = VECTOR_TILES and bits in (2, 4, 8) and G % 32 == 0 and d % 64 == 0 and tile % 16 == 0
    vec4 = vec and bits == 4
    half_d = d // 2
    al = acc.copy()  # the value sums (planar order for int4)
    if vec4:
        for g in range(g_n):
            channels_to_planar(acc[g], 2, al[g])
    qfs = np.empty((g_n, d), np.float32)
    csts = np.empty(g_n, np.float32)
    n_chunks = d // 16
    cscale = np.empty((tile, n_chunks), np.float32)
    chunk_group = np.empty(n_chunks, np.int64)  # value group of each planar chunk of 16 channels
    for k in range(n_chunks):
        chunk_group[k] = (32 * (k % (n_chunks // 2))) // G if vec4 else (16 * k) // G
    for t0 in range(t_lo, t_hi, tile):
        t1 = min(t_hi, t0 + tile)
        nt = t1 - t0
        # 1. scores: quantized key groups, the query folded with each group's scales
        for g0 in range(t0, min(t1, nq), G):
            grp = g0 // G
            off = g0 - t0
            for c in range(d):
                ksf[c] = _f32(k_scale[b, h, grp, c], half)
                kof[c] = _f32(k_offset[b, h, grp, c], half)
            for g in range(g_n):  # each query head with the group's scales, its offsets as a constant
                cst = np.float32(0.0)
                for c in range(d):
                    x = qs[g, c]
                    qfs[g, c] = x * ksf[c]
                    cst += x * kof[c]
                csts[g] = cst
            if vec:
                if vec4:
                    int4_group_scores(k_codes[b, h, grp], qfs, s, off)
                elif bits == 8:
                    int8_group_scores(k_codes[b, h, grp], qfs, s, off)
                else:
                    int2_group_scores(k_codes[b, h, grp], qfs, s, off)
                for g in range(g_n):
                    srow = s[g, off : off + G]
                    for i in range(G):
                        srow[i] += csts[g]
                continue
            if bits == 8:
                for c in range(d):
                    row = k_codes[b, h, grp, c]
                    for i in range(G):
                        kb[c, i] = np.float32(row[i])
            elif bits == 4:
                for c in range(d):
                    row = k_codes[b, h, grp, c]
                    for j in range(nbk):
                        kb64[c, j] = tab[row[j]]
            else:
                for c in range(d):
                    row = k_codes[b, h, grp, c]
                    for j in range(nbk):
                        i2 = 2 * np.int64(row[j])  # the byte's two table words
                        kb64[c, 2 * j] = tab[i2]
                        kb64[c, 2 * j + 1] = tab[i2 + 1]
            for g in range(g_n):
                qf = qfs[g]
                # a view: indices from 0 let the compiler drop negative-index handling and vectorize
                srow = s[g, off : off + G]
                for i in range(G):
                    srow[i] = csts[g]
                for c in range(0, d4, 4):  # four channels per pass over the group's scores
                    w0 = qf[c]
                    w1 = qf[c + 1]
                    w2 = qf[c + 2]
                    w3 = qf[c + 3]
                    k0 = kb[c]
                    k1 = kb[c + 1]
                    k2 = kb[c + 2]
                    k3 = kb[c + 3]
                    for i in range(G):
                        srow[i] += w0 * k0[i] + w1 * k1[i] + w2 * k2[i] + w3 * k3[i]
                for c in range(d4, d):
                    w0 = qf[c]
                    k0 = kb[c]
                    for i in range(G):
                        srow[i] += w0 * k0[i]
        # ... and exact residual keys
        for t in range(max(t0, nq), t1):
            kr = k_res[b, h, t - nq]
            for g in range(g_n):
                qg = qs[g]
                dot = np.float32(0.0)
                for c in range(d):
                    dot += qg[c] * kr[c]
                s[g, t - t0] = dot
        # 2. values of the tile, unpacked once for the group, and their scales and offsets;
        #    exact window values are copied with scale 1 and offset 0
        nqt = max(0, min(nt, nvq - t0))
        if vec:
            for r in range(nqt):
                for j in range(nvg):
                    vsf[j, r] = _f32(v_scale[b, h, t0 + r, j], half)
                    vof[j, r] = _f32(v_offset[b, h, t0 + r, j], half)
                for k in range(n_chunks):
                    cscale[r, k] = vsf[chunk_group[k], r]
            softmax_rows(s, nt, m, l, al)
            for g in range(g_n):
                srow = s[g]
                # offsets: Σ_t p_t voffset_tj on the channels of value group j (two planar runs)
                for j in range(nvg):
                    o = np.float32(0.0)
                    for r in range(nqt):
                        o += srow[r] * vof[j, r]
                    if vec4:
                        lo = j * (G // 2)
                        hi = min(half_d, lo + G // 2)
                        for c in range(lo, hi):
                            al[g, c] += o
                            al[g, half_d + c] += o
                    else:
                        for c in range(j * G, min(d, (j + 1) * G)):
                            al[g, c] += o
                # exact window rows (the tile at the sequence's end)
                for r in range(nqt, nt):
                    p = srow[r]
                    if vec4:
                        for c in range(half_d):
                            al[g, c] += p * v_win[b, h, t0 + r - nvq, 2 * c]
                            al[g, half_d + c] += p * v_win[b, h, t0 + r - nvq, 2 * c + 1]
                    else:
                        for c in range(d):
                            al[g, c] += p * v_win[b, h, t0 + r - nvq, c]
            if nqt:
                if vec4:
                    tile_values_codes_4_scaled(v_codes[b, h], t0, nqt, _CODES16, s, cscale, al)
                elif bits == 8:
                    tile_values_codes_8_scaled(v_codes[b, h], t0, nqt, _CODES16, s, cscale, al)
                else:
                    tile_values_codes_2_scaled(v_codes[b, h], t0, nqt, s, cscale, al)
            continue
        if bits == 8:
            for r in range(nqt):
                row = v_codes[b, h, t0 + r]
                for c in range(d):
                    vb[r, c] = np.float32(row[c])
        elif bits == 4:
            for r in range(nqt):
                row = v_codes[b, h, t0 + r]
                for j in range(nbv):
                    vb64[r, j] = tab[row[j]]
        else:
            for r in range(nqt):
                row = v_codes[b, h, t0 + r]
                for j in range(nbv):
                    i2 = 2 * np.int64(row[j])
                    vb64[r, 2 * j] = tab[i2]
                    vb64[r, 2 * j + 1] = tab[i2 + 1]
        for r in range(nqt):
            for j in range(nvg):
                vsf[j, r] = _f32(v_scale[b, h, t0 + r, j], half)
                vof[j, r] = _f32(v_offset[b, h, t0 + r, j], half)
        for r in range(nqt, nt):
            vb[r, :d] = v_win[b, h, t0 + r - nvq]
            vsf[:, r] = 1.0
            vof[:, r] = 0.0
        r4 = nt - nt % 4
        for g in range(g_n):
            # 3. online softmax: rescale once per tile, then the tile's weights
            srow = s[g]
            softmax_tile(srow, nt, m, l, acc, g, ebits)
            # 4. per value group j: Σ_t (p_t vscale_tj) code_t, four tokens per accumulator
            #    pass, plus Σ_t p_t voffset_tj on each of the group's channels
            for j in range(nvg):
                vsj = vsf[j]
                voj = vof[j]
                o = np.float32(0.0)
                for r in range(nt):
                    p = srow[r]
                    wt[r] = p * vsj[r]
                    o += p * voj[r]
                c0 = j * G
                c1 = min(d, c0 + G)
                w = c1 - c0
                arow = acc[g, c0:c1]  # views indexed from 0, as above
                for c in range(w):
                    arow[c] += o
                for r in range(0, r4, 4):
                    w0 = wt[r]
                    w1 = wt[r + 1]
                    w2 = wt[r + 2]
                    w3 = wt[r + 3]
                    v0 = vb[r, c0:c1]
                    v1 = vb[r + 1, c0:c1]
                    v2 = vb[r + 2, c0:c1]
                    v3 = vb[r + 3, c0:c1]
                    for c in range(w):
                        arow[c] += w0 * v0[c] + w1 * v1[c] + w2 * v2[c] + w3 * v3[c]
                for r in range(r4, nt):
                    w0 = wt[r]
                    v0 = vb[r, c0:c1]
                    for c in range(w):
                        arow[c] += w0 * v0[c]
    if vec4:  # back to channel order
        for g in range(g_n):
            planar_to_channels(al[g], 2, acc[g])
    elif vec:
        acc[:, :] = al


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _finish_head(b, h, m_sp, l_sp, acc_sp, out):
    """Merge the token splits of head ``(b, h)`` (log-sum-exp) and write ``out[b, qh]``."""
    g_n, d = acc_sp.shape[1], acc_sp.shape[2]
    for g in range(g_n):
        top = merge_top(m_sp, g)
        qi = h * g_n + g
        for j in range(d):
            out[b, qi, j] = np.float32(0.0)
        inv = np.float32(1.0) / merge_splits(m_sp, l_sp, acc_sp, g, top, out[b, qi])
        for j in range(d):
            out[b, qi, j] *= inv


# ---- the kernel's part of the shared step (arraykv.ops.numba.fused_driver); args: IntArgs ----

alloc_state, prepare = alloc_queries, prepare_queries  # the state: scaled queries per slot


@nb.njit(inline="always")
def span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc):
    _attend_span(b, h, t_lo, t_hi, state.qs[sb, sh], args, m, l, acc)


@nb.njit(inline="always")
def finish(q, b, h, scale, args, state, sb, sh, m_sp, l_sp, acc_sp, out):
    _finish_head(b, h, m_sp, l_sp, acc_sp, out)


@nb.njit(inline="always")
def span_unit(args):
    """Spans start at key-group boundaries."""
    return args.group_size


# signature 0: float16 scales and offsets (uint16 bit patterns), 1: float32
_step_serial, _step_parallel = build_steps(
    globals(), IntArgs, _SIGS, lambda args: int(args.k_scale.dtype != np.uint16), dims=(64, 128)
)


def _plan(bh: int, n: int, d: int, group_size: int) -> tuple:
    """``(threads, token splits per head)``: :func:`arraykv.ops.numba.fused_driver.plan` of ``bh · n · d``
    values, spans of at least ``4 · TILE`` tokens and one key group."""
    return plan(bh, n, bh * n * d, max(4 * TILE, group_size))


def _params(a):
    """Scales or offsets as the kernel reads them: float16 as its uint16 bit patterns (a view)."""
    if a.dtype == np.float16:
        return a.view(np.uint16)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def int_decode_attention(codec, q, scale):
    """Fused decode attention over an :class:`~arraykv.caches.intq.IntLayerCodec` (NumPy).

    Same contract as :func:`arraykv.attention.int_fused.int_decode_attention_reference`.

    Parameters
    ----------
    codec : IntLayerCodec
        NumPy state: uint8 codes of 2, 4 or 8 bits, float16 or float32 scales and offsets (the
        same dtype for keys and values), residual keys and window values of any float dtype.
    q : ndarray, shape (batch, q_heads, 1, head_dim)
        Any float dtype; computed in float32.
    scale : float
        Softmax scale.

    Returns
    -------
    ndarray, shape (batch, q_heads, 1, head_dim), dtype of ``q``
    """
    b, h, _, d = check_query(codec, q)
    bits = int(codec.bits)
    if bits not in (2, 4, 8):
        raise ValueError(f"codec.bits must be 2, 4 or 8 for this kernel, received {bits}")
    G = int(codec.group_size)
    n = int(codec.n_tokens)
    qh = int(q.shape[1])
    k_scale, k_offset = _params(codec.k_scale), _params(codec.k_offset)
    v_scale, v_offset = _params(codec.v_scale), _params(codec.v_offset)
    if k_scale.dtype != v_scale.dtype:  # the cache stores both in one dtype; a mixed codec reads float32
        k_scale, k_offset, v_scale, v_offset = (
            np.asarray(a, np.float32) for a in (codec.k_scale, codec.k_offset, codec.v_scale, codec.v_offset)
        )
    threads, splits = _plan(b * h, n, d, G)
    out = np.empty((b, qh, d), np.float32)
    n_window = int(getattr(codec, "n_window", 0) or 0)
    v_win = np.ascontiguousarray(codec.v_window, np.float32) if n_window else np.zeros((b, h, 0, d), np.float32)
    args = IntArgs(
        group_size=G,
        bits=bits,
        k_codes=codec.k_codes,
        k_scale=k_scale,
        k_offset=k_offset,
        k_res=np.ascontiguousarray(codec.k_residual, dtype=np.float32),
        v_codes=codec.v_codes,
        v_scale=v_scale,
        v_offset=v_offset,
        v_win=v_win,
        table=_QUADS if bits == 2 else _NIBBLES,
        half=HALF_TO_FLOAT,
    )
    step = Step(np.ascontiguousarray(q.reshape(b, qh, d), dtype=np.float32), float(scale), n, h, args)
    run_step(_step_serial, _step_parallel, threads, splits, b * h * n * d, step, out)
    out = out.reshape(b, qh, 1, d)
    return out if q.dtype == np.float32 else out.astype(q.dtype)
