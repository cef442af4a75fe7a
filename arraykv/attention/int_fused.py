"""Decode attention straight from a group-wise integer (``int2``/``int4``/``int8``) cache layer.

For one new query per head this computes ``softmax(scale · q Kᵀ) V`` over every token of an
:class:`~arraykv.caches.intq.IntLayerCodec` (the quantized key groups, then the exact residual
keys; the quantized values, then the exact window values) without reconstructing the
quantized K or V: the per-channel key scales and offsets are folded into the query once per
key group and the per-token value scales and offsets into the softmax weights.
:func:`int_decode_attention_reference` is the array-API version the kernels are tested
against; ``arraykv.ops.int_decode_attention`` picks a kernel for the namespace (Numba on NumPy,
2-, 4- and 8-bit codes) or this reference.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._types import Array
from .._validation import check_softmax_scale
from ..quant.bitpack import unpack_bits

__all__ = ["int_decode_attention_reference", "check_query", "layer_exponents"]


def check_query(codec: Any, q: Array) -> tuple:
    """Check ``q`` against the layer ``codec`` (shared with the kernels); return ``(b, h, g, d)``."""
    if q.ndim != 4 or int(q.shape[2]) != 1:
        raise ValueError(
            f"q must hold one new token per head (batch, q_heads, 1, head_dim), received shape {tuple(q.shape)}"
        )
    b, qh, _, d = (int(s) for s in q.shape)
    kb, h = (int(s) for s in codec.v_codes.shape[:2])
    if kb != b or qh % h or int(codec.k_residual.shape[3]) != d:
        raise ValueError(
            f"q must have shape (batch={kb}, a multiple of kv_heads={h}, 1, "
            f"head_dim={int(codec.k_residual.shape[3])}), received {tuple(q.shape)}"
        )
    if codec.n_tokens < 1:
        raise ValueError("the layer holds no token to attend to")
    n, G, nw = int(codec.n_tokens), int(codec.group_size), int(getattr(codec, "n_window", 0) or 0)
    ng, nr, nv = int(codec.n_groups), int(codec.n_residual), int(codec.v_codes.shape[2])
    wrows = int(codec.v_window.shape[2]) if nw else 0
    if (
        ng * G + nr != n
        or nv + nw != n
        or int(codec.k_codes.shape[2]) != ng
        or int(codec.k_residual.shape[2]) != nr
        or wrows != nw
    ):
        raise ValueError(
            f"codec counts disagree: n_tokens={n}, keys {ng} groups of {G} + {nr} exact "
            f"(k_codes {int(codec.k_codes.shape[2])} groups, k_residual "
            f"{int(codec.k_residual.shape[2])} rows), values {nv} quantized + {nw} exact "
            f"(v_window {wrows} rows)"
        )
    return b, h, qh // h, d


def int_decode_attention_reference(codec: Any, q: Array, scale: float) -> Array:
    """Array-API version of :func:`int_decode_attention`, with the same scale/offset folding.

    Same inputs and output as :func:`int_decode_attention`. Memory is
    O(tokens · head_dim): it unpacks every code (as float32), but never forms ``scale · code +
    offset``; the fused kernels unpack a tile at a time.

    Notes
    -----
    With ``q' = scale · q`` and key group ``grp`` holding tokens ``t = grp·G + i``::

        s_t = Σ_c (q'_c · kscale_{grp,c}) code_{t,c} + Σ_c q'_c · koffset_{grp,c}

    (one matrix product per group against its ``(head_dim, G)`` code block) and ``s_t = q'·k_t``
    for the residual keys. With ``p_t = exp(s_t − max s)`` and value channel ``c`` in group
    ``j``::

        Σ_t p_t v_{t,c} = Σ_t (p_t · vscale_{t,j}) code_{t,c} + Σ_t p_t · voffset_{t,j}

    for the quantized values, ``Σ_t p_t v_t`` for the ``n_window`` exact ones (the latest
    tokens), and the output is the sum divided by ``Σ_t p_t``. A layer stored in units of
    ``2**k_exp`` / ``2**v_exp`` (``codec.k_exp``, ``codec.v_exp``) multiplies ``q'`` by
    ``2**k_exp`` and the output by ``2**v_exp``.
    """
    scale = check_softmax_scale(scale, "scale")
    xp = _compat.namespace(q)
    b, h, g, d = check_query(codec, q)
    dev = _compat.device(q)
    f32 = xp.float32
    G, bits = int(codec.group_size), int(codec.bits)
    ng, n = int(codec.n_groups), int(codec.n_tokens)
    k_exp, v_exp = layer_exponents(codec)
    qf = xp.reshape(xp.astype(q, f32), (b, h, g, d)) * (float(scale) * 2.0**k_exp)
    parts = []
    if ng:
        kc = xp.astype(unpack_bits(codec.k_codes, bits, G), f32)  # (b, h, ng, d, G)
        ks = xp.astype(codec.k_scale, f32)  # (b, h, ng, d)
        ko = xp.astype(codec.k_offset, f32)
        qs = qf[:, :, None, :, :] * ks[:, :, :, None, :]  # (b, h, ng, g, d): the query folded per group
        const = xp.matmul(ko, xp.matrix_transpose(qf))  # (b, h, ng, g)
        sq = xp.matmul(qs, kc) + const[..., None]  # (b, h, ng, g, G)
        parts.append(xp.reshape(xp.permute_dims(sq, (0, 1, 3, 2, 4)), (b, h, g, ng * G)))
    if int(codec.n_residual):
        kr = xp.astype(codec.k_residual, f32)  # (b, h, r, d)
        parts.append(xp.matmul(qf, xp.matrix_transpose(kr)))  # (b, h, g, r)
    s = parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)  # (b, h, g, n)
    m = xp.max(s, axis=-1, keepdims=True)
    p = xp.exp(s - m)
    den = xp.sum(p, axis=-1)  # (b, h, g)
    nw = int(getattr(codec, "n_window", 0) or 0)
    nv = n - nw  # quantized values
    pq = p[..., :nv] if nw else p
    vs = xp.astype(codec.v_scale, f32)  # (b, h, nv, nvg)
    vo = xp.astype(codec.v_offset, f32)
    nvg = int(vs.shape[-1])
    vc = xp.astype(unpack_bits(codec.v_codes, bits, d), f32)  # (b, h, nv, d)
    pad = nvg * G - d
    if pad:
        vc = xp.concat([vc, xp.zeros((b, h, nv, pad), dtype=f32, device=dev)], axis=-1)
    vcg = xp.permute_dims(xp.reshape(vc, (b, h, nv, nvg, G)), (0, 1, 3, 2, 4))  # (b, h, nvg, nv, G)
    w = pq[..., None] * vs[:, :, None, :, :]  # (b, h, g, nv, nvg): weights folded with the value scales
    acc = xp.matmul(xp.permute_dims(w, (0, 1, 4, 2, 3)), vcg)  # (b, h, nvg, g, G)
    acc = xp.permute_dims(acc, (0, 1, 3, 2, 4))  # (b, h, g, nvg, G)
    off = xp.matmul(pq, vo)  # (b, h, g, nvg)
    num = xp.reshape(acc + off[..., None], (b, h, g, nvg * G))[..., :d]
    if nw:  # exact window values: Σ_t p_t v_t
        num = num + xp.matmul(p[..., nv:], xp.astype(codec.v_window, f32))  # (b, h, g, d)
    out = num / den[..., None]
    if v_exp:
        out = out * 2.0**v_exp
    return xp.astype(xp.reshape(out, (b, h * g, 1, d)), q.dtype)


def layer_exponents(codec: Any) -> tuple:
    """``(k_exp, v_exp)``: a layer's stored keys are ``2**-k_exp`` and values ``2**-v_exp`` times the true ones."""
    return int(getattr(codec, "k_exp", 0) or 0), int(getattr(codec, "v_exp", 0) or 0)
