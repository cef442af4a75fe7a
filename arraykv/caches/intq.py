"""KIVI-style group-wise integer caches: ``int4`` and ``int8``.

Keys are quantized per channel over groups of ``group_size`` tokens, values per token over
groups of ``group_size`` channels; the latest keys stay in full precision until a group fills.
"""

from __future__ import annotations

from typing import Any

from ..protocol import AttendConfig, Dequantized, DequantResult
from ..quant.intq import IntQuantized, dequantize_groups, quantize_groups
from ..storage import TokenBuffers
from .._validation import check_int
from .base import LayeredCache, LayerState
from .registry import register_method

__all__ = ["IntQuantCache", "Int4Cache", "Int8Cache"]

_SCALE_DTYPES = ("float16", "float32")


class IntQuantCache(LayeredCache):
    """Group-wise asymmetric integer K/V cache (KIVI: per-channel keys, per-token values).

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, check_finite, max_tokens
        As for every cache (:class:`~arraykv.caches.LayeredCache`).
    group_size : int, default 32
        Tokens per key group and channels per value group.
    scale_dtype : {"float16", "float32"}, default "float16"
        Dtype of the per-group scales and offsets. Namespaces without float16
        (``array_api_strict``) store float32.

    Notes
    -----
    State of a layer (``b`` batch, ``h`` heads, ``d`` head_dim, ``G`` group_size, ``β`` bits):

    ``k_codes`` (b, h, groups, d, G·β/8) uint8
        Keys of each full group of ``G`` tokens, one row per channel, codes packed along the
        tokens (INT4: two per byte).
    ``k_scale``, ``k_offset`` (b, h, groups, d)
        One scale and offset per (group, channel).
    ``k_residual`` (b, h, r, d), ``r < G``, input dtype
        The latest keys, kept exactly until ``G`` of them fill a group.
    ``v_codes`` (b, h, tokens, ceil(d·β/8)) uint8; ``v_scale``, ``v_offset`` (b, h, tokens, ceil(d/G))
        Values, quantized per token as they arrive.

    KIVI (Liu et al., 2024) observed that key caches have outlier *channels* (a few channels
    with large magnitude in every token) while value errors matter per token; quantizing keys
    per channel confines each outlier channel to its own scale. Each code is
    ``clip(floor((x - offset) / scale + 1/2), 0, 2^β - 1)`` with ``scale = (max - min) / (2^β - 1)``
    per group, so the error is at most half a step. Bits per value with float16 parameters:
    ``β + 32 / G`` (5 for INT4, 9 for INT8 at ``G = 32``), plus the residual.
    ``decode`` returns :class:`~arraykv.Dequantized`: the whole layer is dequantized each step
    (with a Numba kernel on CPU).
    """

    method = "int"
    bits = 8

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, group_size: int = 32,
                 scale_dtype: str = "float16", check_finite: bool = True, max_tokens: int | None = None):
        super().__init__(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         check_finite=check_finite, max_tokens=max_tokens)
        self.group_size = check_int("group_size", group_size, low=1)
        if scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {_SCALE_DTYPES}, received {scale_dtype!r}")
        self.scale_dtype = scale_dtype

    def _extra_config(self) -> dict:
        return {"group_size": self.group_size, "scale_dtype": self.scale_dtype}

    def _pdt(self, xp: Any) -> str:
        return self.scale_dtype if hasattr(xp, self.scale_dtype) else "float32"

    # -- state ----------------------------------------------------------------------
    def _new_layer(self, xp, dev, batch, dtype) -> LayerState:
        st = super()._new_layer(xp, dev, batch, dtype)
        mt = self.max_tokens
        st.extra["kq"] = TokenBuffers(max_tokens=None if mt is None else -(-mt // self.group_size), min_capacity=4)
        st.extra["vq"] = TokenBuffers(max_tokens=mt)
        st.extra["k_residual"] = xp.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=dtype, device=dev)
        return st

    def _encode(self, st: LayerState, k: Any, v: Any) -> tuple:
        """Everything a store writes, computed before anything changes."""
        xp = st.xp
        g = self.group_size
        pdt = self._pdt(xp)
        allk = xp.concat([st.extra["k_residual"], k], axis=2)
        b, h, n, d = (int(s) for s in allk.shape)
        full = n // g
        kq = None
        if full:
            blk = xp.reshape(allk[:, :, : full * g, :], (b, h, full, g, d))
            blk = xp.permute_dims(blk, (0, 1, 2, 4, 3))  # (b, h, groups, d, G): tokens last
            q = quantize_groups(blk, self.bits, g, param_dtype=pdt)
            kq = {"k_codes": q.codes, "k_scale": q.scale[..., 0], "k_offset": q.offset[..., 0]}
        residual = xp.asarray(allk[:, :, full * g :, :], copy=True)
        qv = quantize_groups(v, self.bits, g, param_dtype=pdt)
        vq = {"v_codes": qv.codes, "v_scale": qv.scale, "v_offset": qv.offset}
        return kq, vq, residual

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        kq, vq, residual = self._encode(st, k, v)
        if kq is not None:
            st.extra["kq"].check_room(int(kq["k_codes"].shape[2]))
        st.extra["vq"].check_room(int(v.shape[2]))
        if kq is not None:
            st.extra["kq"].append(kq)
        st.extra["vq"].append(vq)
        st.extra["k_residual"] = residual

    def _decoded(self, st: LayerState) -> DequantResult:
        xp = st.xp
        g, d = self.group_size, self.head_dim
        kq, vq = st.extra["kq"], st.extra["vq"]
        parts = []
        if kq.length:
            q = IntQuantized(codes=kq.view("k_codes"), scale=kq.view("k_scale")[..., None],
                             offset=kq.view("k_offset")[..., None], bits=self.bits, group_size=g, n=g)
            blk = dequantize_groups(q, st.dtype)  # (b, h, groups, d, G)
            b, h, ng = (int(s) for s in blk.shape[:3])
            parts.append(xp.reshape(xp.permute_dims(blk, (0, 1, 2, 4, 3)), (b, h, ng * g, d)))
        parts.append(st.extra["k_residual"])
        k = parts[0] if len(parts) == 1 else xp.concat(parts, axis=2)
        qv = IntQuantized(codes=vq.view("v_codes"), scale=vq.view("v_scale"), offset=vq.view("v_offset"),
                          bits=self.bits, group_size=g, n=d)
        v = dequantize_groups(qv, st.dtype)
        return DequantResult(k=k, v=v)

    # -- hooks ----------------------------------------------------------------------
    def _prefill(self, st, k, v, q):
        self._store(st, k, v)
        return self._decoded(st)

    def _decode(self, st, k, v, q, config: AttendConfig):
        self._store(st, k, v)
        return Dequantized(self._decoded(st))

    def _dequantize(self, st) -> DequantResult:
        return self._decoded(st)

    def _layer_arrays(self, st) -> dict:
        out = dict(st.extra["kq"].arrays())
        out.update(st.extra["vq"].arrays())
        out["k_residual"] = st.extra["k_residual"]
        return out

    def _restore_layer(self, xp, dev, batch, dtype, length, arrays) -> LayerState:
        st = self._new_layer(xp, dev, batch, dtype)
        kq = {n: arrays[n] for n in ("k_codes", "k_scale", "k_offset") if n in arrays}
        if kq and int(kq["k_codes"].shape[2]):
            st.extra["kq"].append(kq)
        vq = {n: arrays[n] for n in ("v_codes", "v_scale", "v_offset") if n in arrays}
        if vq and int(vq["v_codes"].shape[2]):
            st.extra["vq"].append(vq)
        st.extra["k_residual"] = xp.asarray(arrays["k_residual"], copy=True)
        st.length = length
        return st

    def _layer_nbytes(self, st) -> int:
        from .. import _compat

        return (st.extra["kq"].used_nbytes() + st.extra["vq"].used_nbytes()
                + _compat.array_nbytes(st.extra["k_residual"]))

    def _layer_reserved_nbytes(self, st) -> int:
        from .. import _compat

        return (st.extra["kq"].reserved_nbytes() + st.extra["vq"].reserved_nbytes()
                + _compat.array_nbytes(st.extra["k_residual"]))


@register_method("int4")
class Int4Cache(IntQuantCache):
    """INT4 KIVI-style cache (two codes per byte); see :class:`IntQuantCache`."""

    method = "int4"
    bits = 4


@register_method("int8")
class Int8Cache(IntQuantCache):
    """INT8 KIVI-style cache; see :class:`IntQuantCache`."""

    method = "int8"
    bits = 8
