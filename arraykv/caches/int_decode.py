"""Reading an integer-cache layer back: K/V from its key groups, value rows and exact tokens."""

from __future__ import annotations

from .. import ops
from .._types import Array
from ..protocol import DequantResult
from ..quant.intq import IntQuantized, dequantize_groups
from .int_codec import IntLayer

__all__ = ["decode_int_layer"]


def decode_int_layer(st: IntLayer, bits: int, group_size: int, windowed: bool, start: int = 0) -> DequantResult:
    """K/V of the tokens ``start ..`` of layer ``st`` in its dtype: (b, h, total - start, d) each.

    Only the key groups and value rows holding a token from ``start`` on are decoded. A key of
    a full group is ``scale · code + offset`` per channel (times ``2**k_exp``), a value the same
    per channel group; the latest keys and (with a window, ``windowed``) values are exact.
    """
    xp = st.xp
    g = group_size
    d = int(st.k_residual.shape[-1])
    kq, vq = st.kq, st.vq
    ek, ev = (e or 0 for e in st.exp)
    parts = []
    g0 = min(start // g, kq.length)  # first key group holding a token from ``start`` on
    if kq.length > g0:

        def kview(name: str) -> Array:
            a = kq.view(name)
            return a if g0 == 0 else a[:, :, g0:, ...]

        q = IntQuantized(
            codes=kview("k_codes"),
            scale=kview("k_scale")[..., None],
            offset=kview("k_offset")[..., None],
            bits=bits,
            group_size=g,
            n=g,
            exponent=ek,
        )
        blk = dequantize_groups(q, st.dtype, dequantize=ops.intq_dequantize)  # (b, h, groups, d, G)
        b, h, ng = (int(s) for s in blk.shape[:3])
        kd = xp.reshape(xp.permute_dims(blk, (0, 1, 2, 4, 3)), (b, h, ng * g, d))
        skip = start - g0 * g
        parts.append(kd if skip == 0 else kd[:, :, skip:, :])
    r0 = max(0, start - kq.length * g)
    parts.append(_exact(st, st.k_residual, r0, ek))
    k = parts[0] if len(parts) == 1 else xp.concat(parts, axis=2)
    parts = []
    if vq.length > start:

        def vview(name: str) -> Array:
            a = vq.view(name)
            return a if start == 0 else a[:, :, start:, ...]

        qv = IntQuantized(
            codes=vview("v_codes"),
            scale=vview("v_scale"),
            offset=vview("v_offset"),
            bits=bits,
            group_size=g,
            n=d,
            exponent=ev,
        )
        parts.append(dequantize_groups(qv, st.dtype, dequantize=ops.intq_dequantize))
    if windowed or not parts:
        parts.append(_exact(st, st.v_window, max(0, start - vq.length), ev))
    v = parts[0] if len(parts) == 1 else xp.concat(parts, axis=2)
    return DequantResult(k=k, v=v)


def _exact(st: IntLayer, a: Array, skip: int, exp: int = 0) -> Array:
    """Exact tokens ``skip ..`` of ``a`` (``k_residual`` or ``v_window``) times ``2**exp``, in the layer's dtype.

    A copy.
    """
    a = a[:, :, skip:, :]
    if exp:
        return st.xp.astype(st.xp.astype(a, st.xp.float32) * 2.0**exp, st.dtype)
    return st.xp.asarray(a, copy=True) if a.dtype == st.dtype else st.xp.astype(a, st.dtype)
