"""Scores against 1-bit sign sketches sixteen signs at a time (Numba, vector masks).

A ``tq`` cache adds to each key's logit a QJL correction ``‖r‖ · ⟨S q, sign(S r)⟩``: the
sketched query ``S q`` (m values) against the ``m`` stored signs of the key's residual
(:mod:`arraykv.quant.qjl`). With vector masks the signs need no unpacking: two packed bytes are a
16-lane mask (sign ``i`` is bit ``i % 8`` of byte ``i // 8``, so bit ``k`` of the little-endian
16-bit word at byte ``2c`` is sign ``16c + k``), and one ``select`` between the sixteen sketched
query values and their negatives gives their signed products. :func:`tile_sign_scores` does a
tile of rows for every query head, four to eight rows per pass with the lane sums of
:mod:`arraykv.ops.numba.ir_tiles`; :func:`tile_sign_scores_loop` is the plain loop it is checked
against (and what runs without :data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS`).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .ir_tiles import array_args, c_f32, emit_scores, g_blocks_any, vec_helpers

__all__ = ["tile_sign_scores", "tile_sign_scores_loop"]


def _sign_scores_codegen(context, builder, sig, args):
    h = vec_helpers()
    ir = h.ir
    c_arr = context.make_array(sig.args[0])(context, builder, args[0])
    c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
    t0, nt = args[1], args[2]
    (sq, (g_n, m)), (s, (_, s_w)) = array_args(context, builder, sig, args, (3, 4))
    i16 = ir.IntType(16)
    v16i1 = ir.VectorType(ir.IntType(1), 16)
    chunks = builder.udiv(m, h.const(16))
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]

    def fill(g0, gb, r0, n_rows):  # n_rows (python int) rows from row r0 (relative to t0)
        rows = [
            builder.gep(c_arr.data, [builder.mul(builder.add(t0, builder.add(r0, h.const(i))), c_stride)])
            for i in range(n_rows)
        ]
        with h.cgutils.for_range(builder, chunks) as lc:
            off = builder.mul(lc.index, h.const(16))
            pos = [
                h.vload(builder, sq, builder.add(builder.mul(builder.add(g0, h.const(gi)), m), off)) for gi in range(gb)
            ]
            neg = [builder.fneg(p) for p in pos]
            for i in range(n_rows):
                word = builder.load(
                    builder.bitcast(builder.gep(rows[i], [builder.mul(lc.index, h.const(2))]), i16.as_pointer()),
                    align=1,
                )
                mask = builder.bitcast(word, v16i1)
                for gi in range(gb):
                    a = accs[gi * n_rows + i]
                    builder.store(builder.fadd(builder.load(a), builder.select(mask, pos[gi], neg[gi])), a)

    g_blocks_any(builder, h, g_n, emit_scores(builder, h, nt, s, s_w, accs, lambda gb: 4 if gb >= 3 else 8, fill))
    return context.get_dummy_value()


@intrinsic
def tile_sign_scores(typingctx, signs, t0, nt, sq, s):
    """``s[g, r] = Σ_i sq[g, i] · (+1 if sign i of row t0 + r is set else −1)`` for ``r < nt``.

    ``signs`` uint8 (T, ≥ m / 8) with contiguous bytes in a row (any row stride), sign ``i`` of
    a row at bit ``i % 8`` of byte ``i // 8``; ``sq`` (G, m) and ``s`` (G, ≥ nt) C-contiguous
    float32, ``m`` a multiple of 16. Not checked at run time.
    Needs :data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS` (AVX-512 or AVX2).
    """
    ok = (
        isinstance(signs, nbt.Array)
        and signs.ndim == 2
        and signs.dtype == nbt.uint8
        and c_f32(sq, s)
        and sq.ndim == 2
        and s.ndim == 2
        and all(isinstance(v, nbt.Integer) for v in (t0, nt))
    )
    if not ok:
        return None
    return nbt.void(signs, nbt.int64, nbt.int64, sq, s), _sign_scores_codegen


@nb.njit
def tile_sign_scores_loop(signs, t0, nt, sq, s):
    """Reference of :func:`tile_sign_scores`, one sign at a time."""
    for g in range(sq.shape[0]):
        for r in range(nt):
            x = np.float32(0.0)
            for i in range(sq.shape[1]):
                bit = (signs[t0 + r, i >> 3] >> (i & 7)) & 1
                x += sq[g, i] if bit else -sq[g, i]
            s[g, r] = x
