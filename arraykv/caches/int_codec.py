"""The state of an integer-cache layer, and the packed view of it that a fused kernel reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._types import Array, DType
from ..quant.bitpack import packed_nbytes
from ..storage import TokenBuffers
from .base import LayerState

__all__ = ["IntLayer", "IntLayerCodec", "codec_state"]


@dataclass
class IntLayer(LayerState):
    """One layer of an :class:`IntQuantCache` (array names as in its Notes).

    Attributes
    ----------
    kq : TokenBuffers
        ``k_codes``, ``k_scale``, ``k_offset`` of the full key groups (axis 2: groups).
    vq : TokenBuffers
        ``v_codes``, ``v_scale``, ``v_offset`` of the quantized values (axis 2: tokens).
    k_residual, v_window : array (b, h, n, d)
        The exact keys of the unfilled groups and the exact recent values.
    exp : tuple of (int or None)
        Powers of two of the units of keys and values; None until the layer held non-zero data.
    k_rollback, v_rollback : array (b, h, n, d)
        Rollback copies (:mod:`arraykv.caches.rollback`): the exact keys of the last quantized
        key chunks and the exact values that last left the window, in the exact tokens' dtype.
    """

    kq: TokenBuffers = None  # type: ignore[assignment]  # set when the layer is created
    vq: TokenBuffers = None  # type: ignore[assignment]
    k_residual: Array = None
    v_window: Array = None
    exp: tuple[int | None, ...] = (None, None)
    k_rollback: Array = None
    v_rollback: Array = None
    undo: ClassVar[str] = "fields"  # token buffers appended to, the rest replaced by each store

    def buffers(self) -> tuple[TokenBuffers, ...]:
        return (self.kq, self.vq)


@dataclass(frozen=True)
class IntLayerCodec:
    """Everything a kernel needs to read one layer of an :class:`IntQuantCache` (views, no copies).

    The layer holds ``n_tokens`` tokens. Keys: the first ``n_groups · G`` are quantized, the
    last ``n_residual`` exact. Values: the first ``n_tokens − n_window`` are quantized, the last
    ``n_window`` exact (the two boundaries are independent). With ``G = group_size``, token
    ``t = grp · G + i`` of head ``(b, h)`` has key channel ``c``::

        k[c] = k_scale[b,h,grp,c] · unpack(k_codes[b,h,grp,c])[i] + k_offset[b,h,grp,c]   (t < n_groups·G)
        k[c] = k_residual[b,h,t - n_groups·G,c]                                             (otherwise)

    and value channel ``c``, in channel group ``j = c // G``, with ``n_q = n_tokens − n_window``::

        v[c] = v_scale[b,h,t,j] · unpack(v_codes[b,h,t])[c] + v_offset[b,h,t,j]             (t < n_q)
        v[c] = v_window[b,h,t - n_q,c]                                                      (otherwise)

    ``unpack`` is :func:`arraykv.quant.bitpack.unpack_bits` (INT2: four codes per byte, the
    first in the lowest two bits; INT4: low nibble first).

    Attributes
    ----------
    bits : int
        Bits per code (2, 4 or 8 for the registered caches).
    group_size : int
        ``G``: tokens per key group, channels per value group.
    n_tokens, n_groups, n_residual : int
        Tokens held, full key groups, exact keys (``n_tokens = n_groups · G + n_residual``).
    k_codes : uint8 (batch, kv_heads, n_groups, head_dim, ceil(G·bits/8))
    k_scale, k_offset : float16 or float32 (batch, kv_heads, n_groups, head_dim)
    k_residual : (batch, kv_heads, n_residual, head_dim)
        float16 when the cache has a window (``residual_window > 0``), else the input dtype.
    v_codes : uint8 (batch, kv_heads, n_tokens − n_window, ceil(head_dim·bits/8))
    v_scale, v_offset : float16 or float32 (batch, kv_heads, n_tokens − n_window, ceil(head_dim/G))
    n_window : int, default 0
        Exact values (the most recent tokens); 0 without a window (``int4``/``int8`` by default).
    v_window : float16 (batch, kv_heads, n_window, head_dim) or None
        The exact values (float32 on namespaces without float16); None when ``n_window == 0``.
    k_exp, v_exp : int, default 0
        Every key (quantized or exact) is ``2**k_exp`` times what the formulas above give,
        every value ``2**v_exp`` times (see :func:`arraykv.quant.intq.half_exponent`); 0
        unless the layer's data is very small or very large.
    """

    bits: int
    group_size: int
    n_tokens: int
    n_groups: int
    n_residual: int
    k_codes: Array
    k_scale: Array
    k_offset: Array
    k_residual: Array
    v_codes: Array
    v_scale: Array
    v_offset: Array
    n_window: int = 0
    v_window: Array | None = None
    k_exp: int = 0
    v_exp: int = 0


def codec_state(st: IntLayer, bits: int, group_size: int, param_dtype: DType) -> IntLayerCodec:
    """The :class:`IntLayerCodec` of layer ``st`` (views; empty arrays where nothing is quantized yet).

    ``param_dtype`` is the dtype of the scales and offsets (for the empty ones).
    """
    xp = st.xp
    g = group_size
    _, h, _, d = (int(s) for s in st.k_residual.shape)
    kq, vq = st.kq, st.vq
    if kq.length:
        k_codes, k_scale, k_offset = kq.view("k_codes"), kq.view("k_scale"), kq.view("k_offset")
    else:
        lead: tuple[int, ...] = (st.batch, h, 0, d)
        k_codes = xp.zeros(lead + (packed_nbytes(g, bits),), dtype=xp.uint8, device=st.device)
        k_scale = xp.zeros(lead, dtype=param_dtype, device=st.device)
        k_offset = k_scale
    if vq.length:
        v_codes, v_scale, v_offset = vq.view("v_codes"), vq.view("v_scale"), vq.view("v_offset")
    else:  # every value is in the window, or the layer was created by an empty prefill
        lead = (st.batch, h, 0)
        v_codes = xp.zeros(lead + (packed_nbytes(d, bits),), dtype=xp.uint8, device=st.device)
        v_scale = xp.zeros(lead + (-(-d // g),), dtype=param_dtype, device=st.device)
        v_offset = v_scale
    residual, window = st.k_residual, st.v_window
    n_window = int(window.shape[2])
    ek, ev = (e or 0 for e in st.exp)
    return IntLayerCodec(
        bits=bits,
        group_size=g,
        n_tokens=vq.length + n_window,
        n_groups=kq.length,
        n_residual=int(residual.shape[2]),
        k_codes=k_codes,
        k_scale=k_scale,
        k_offset=k_offset,
        k_residual=residual,
        v_codes=v_codes,
        v_scale=v_scale,
        v_offset=v_offset,
        n_window=n_window,
        v_window=window if n_window else None,
        k_exp=ek,
        v_exp=ev,
    )
