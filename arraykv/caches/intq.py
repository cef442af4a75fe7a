"""KIVI-style group-wise integer caches: ``int2``, ``int4`` and ``int8``.

Keys are quantized per channel over groups of ``group_size`` tokens, values per token over
groups of ``group_size`` channels. Exact (unquantized) tokens: the latest keys until a group
fills (with ``residual_window > 0``, a window's worth of groups) and, with a window (``int2``),
the most recent values; with a window both are held in float16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import _compat, ops
from .._types import Array, Device, DType, Namespace
from .._validation import check_int, dtype_name
from ..protocol import AttendConfig, Dequantized, DequantResult, Fused
from ..quant.intq import HALF_MAX, half_exponent, quantize_groups
from ..storage import TokenBuffers
from .base import LayeredCache, check_decode_path
from .int_codec import IntLayer, IntLayerCodec, codec_state
from .int_decode import decode_int_layer
from .int_state import int_layout, key_copies, layer_arrays, restore_layer, truncate_floor, truncate_plan
from .layout import Layout
from .restore_checks import check_int_room
from .rollback import DEFAULT_ROLLBACK_TOKENS, RECORD_NBYTES, check_rollback_tokens, keep_last

_INTQ_OPS: dict[str, Callable[..., Any]] = {
    "group_minmax": ops.intq_group_minmax,
    "quantize_pack": ops.intq_quantize_pack,
}

__all__ = ["IntQuantCache", "Int2Cache", "Int4Cache", "Int8Cache", "IntLayerCodec", "IntLayer"]

_SCALE_DTYPES = ("float16", "float32")
_BITS = (2, 4, 8)


class IntQuantCache(LayeredCache[IntLayer]):
    """Group-wise asymmetric integer K/V cache (KIVI: per-channel keys, per-token values).

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, check_finite, max_tokens
        As for every cache (:class:`~arraykv.caches.LayeredCache`).
    bits : {2, 4, 8}, default 8
        Bits per code; only for the generic method ``"int"`` (``int2``/``int4``/``int8`` fix it).
    group_size : int, default 32
        Tokens per key group and channels per value group.
    scale_dtype : {"float16", "float32"}, default "float16"
        Dtype of the per-group scales and offsets. Namespaces without float16
        (``array_api_strict``) store float32.
    residual_window : int or None, default None
        ``R``, 0 or a multiple of ``group_size``: KIVI's full-precision residual. The latest
        ``R`` values and the latest ``n mod R`` keys of ``n`` tokens are held in float16
        (float32 on namespaces without float16); a value is quantized when it leaves the
        window, keys ``R`` at a time (``R / group_size`` groups) when ``R`` have gathered.
        None: the class default (:attr:`default_residual_window`: 32 for ``int2``, 0 for
        ``int4``/``int8``). With 0, values are quantized on arrival and the keys of an unfilled
        group are held exactly, in the input dtype.
    rollback_tokens : int, default 16
        Tokens a layer can always be truncated by (:meth:`truncate`) after the call that fixed
        its units: the exact keys of the last ``ceil(rollback_tokens / chunk)`` quantized key
        chunks (``chunk``: ``residual_window``, else ``group_size``) and, with a window, the
        last ``rollback_tokens`` values that left it are kept (counted in ``memory_usage``).
    decode_path : {"auto", "fused", "dequantized"}, default "auto"
        How ``decode`` attends: ``"auto"`` from the packed codes (:class:`~arraykv.Fused`)
        when a fused kernel exists for the namespace (Numba on NumPy), else it returns
        :class:`~arraykv.Dequantized`; ``"fused"`` always attends itself (the array-API
        version, :mod:`arraykv.attention.int_fused`, where no kernel exists);
        ``"dequantized"`` always dequantizes the layer for the caller.

    Notes
    -----
    State of a layer of ``n`` tokens (``b`` batch, ``h`` heads, ``d`` head_dim, ``G``
    group_size, ``β`` bits, ``R`` residual_window):

    ``k_codes`` (b, h, groups, d, G·β/8) uint8
        Keys of each full group of ``G`` tokens, one row per channel, codes packed along the
        tokens (INT4: two per byte, INT2: four).
    ``k_scale``, ``k_offset`` (b, h, groups, d)
        One scale and offset per (group, channel).
    ``k_residual`` (b, h, n mod R, d) (``n mod G`` when ``R = 0``)
        The latest keys, exact: float16 when ``R > 0``, else the input dtype.
    ``v_codes`` (b, h, n − w, ceil(d·β/8)) uint8; ``v_scale``, ``v_offset`` (b, h, n − w, ceil(d/G))
        Values, quantized per token.
    ``v_window`` (b, h, w, d) float16, ``w = min(n, R)``; held (and saved) only when ``R > 0``
        The latest values, exact.

    KIVI (Liu et al., 2024, *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*)
    observed that key caches have outlier *channels* (a few channels with large magnitude in
    every token) while value errors matter per token; quantizing keys per channel confines
    each outlier channel to its own scale. Its Algorithm 1 also keeps a full-precision
    residual (R = 32–128 in the paper): keys gather until ``R`` are held, then are quantized
    together; the latest ``R`` values slide. Each code is
    ``clip(floor((x - offset) / scale + 1/2), 0, 2^β - 1)`` with
    ``scale = (max - min) / (2^β - 1)`` per group, so the error is at most half a step.
    Bits per value with float16 parameters: ``β + 32 / G`` (3 for INT2, 5 for INT4, 9 for INT8
    at ``G = 32``), plus the exact tokens: on average ``16 · ((R − 1)/2 + R) / (2n)`` more
    (0.05 at ``n = 8192``, ``R = G = 32``). Tokens enter the residual rounded to its dtype and
    are quantized from there at positions fixed by ``n``, so what is stored does not depend on
    how the tokens were split into calls.
    ``decode`` attends straight from the codes when the fused path is taken (see
    ``decode_path``): the per-channel key scales fold into the query once per group,
    ``q·k_t = Σ_c (q_c · scale_c) code_{t,c} + Σ_c q_c · offset_c``, and the per-token value
    scales into the softmax weights (:func:`arraykv.ops.int_decode_attention`).
    Otherwise the whole layer is dequantized each step (with a Numba kernel on CPU) and
    returned as :class:`~arraykv.Dequantized`.

    Magnitude: a layer keeps its keys in units of ``2**k_exp`` and its values in units of
    ``2**v_exp`` (:func:`arraykv.quant.intq.half_exponent` of the first non-zero store; 0 for
    data whose largest magnitude lies between ``2**-6`` and ``2**12``), so float16 scales and
    windows hold data of magnitude 1e-8 to beyond 65504 with the same relative error and no
    extra bytes per value. A later store that would still exceed float16 in those units is
    refused (``ValueError``) before anything changes.
    """

    method = "int"
    bits = 8
    #: ``residual_window`` when the constructor is given None.
    default_residual_window = 0

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int | None = None,
        group_size: int = 32,
        scale_dtype: str = "float16",
        residual_window: int | None = None,
        rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
        decode_path: str = "auto",
        check_finite: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            check_finite=check_finite,
            max_tokens=max_tokens,
        )
        if bits is not None:
            if type(self).method != "int":
                raise TypeError(
                    f"method {self.method!r} does not take bits (it fixes bits={type(self).bits}; "
                    "method 'int' takes it)"
                )
            bits = check_int("bits", bits, low=2, high=8)
            if bits not in _BITS:
                raise ValueError(f"bits must be one of {_BITS}, received {bits}")
            self.bits = bits
        self.group_size = check_int("group_size", group_size, low=1)
        if scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {_SCALE_DTYPES}, received {scale_dtype!r}")
        self.scale_dtype = scale_dtype
        if residual_window is None:
            residual_window = self.default_residual_window
        self.residual_window = check_int("residual_window", residual_window, low=0)
        if self.residual_window % self.group_size:
            raise ValueError(
                f"residual_window must be 0 or a multiple of group_size={self.group_size}, "
                f"received {self.residual_window}"
            )
        self.rollback_tokens = check_rollback_tokens(rollback_tokens)
        self.decode_path = check_decode_path(decode_path)

    def _extra_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"bits": self.bits} if type(self).method == "int" else {}
        cfg.update(
            group_size=self.group_size,
            scale_dtype=self.scale_dtype,
            residual_window=self.residual_window,
            rollback_tokens=self.rollback_tokens,
            decode_path=self.decode_path,
        )
        return cfg

    def _pdt(self, xp: Namespace) -> str:
        return self.scale_dtype if hasattr(xp, self.scale_dtype) else "float32"

    def _exact_dtype(self, xp: Namespace, dtype: DType) -> DType:
        """Dtype of the exact tokens: half precision with a window, else the input ``dtype``."""
        return (getattr(xp, "float16", None) or xp.float32) if self.residual_window else dtype

    # -- state ----------------------------------------------------------------------
    def _new_layer(self, xp: Namespace, dev: Device, batch: int, dtype: DType) -> IntLayer:
        mt = self.max_tokens
        empty = xp.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=self._exact_dtype(xp, dtype), device=dev)
        return IntLayer(
            xp=xp,
            device=dev,
            batch=batch,
            dtype=dtype,
            # key groups: steps of 4 groups (128 tokens at the default group size), never more
            kq=TokenBuffers(max_tokens=None if mt is None else -(-mt // self.group_size), min_capacity=4, max_step=4),
            vq=TokenBuffers(max_tokens=mt),
            k_residual=empty,
            v_window=empty,
            k_rollback=empty,
            v_rollback=empty,
        )

    def _encode(self, st: IntLayer, k: Array, v: Array) -> tuple:
        """Everything a store writes, computed before anything changes.

        Returns ``(kq, vq, k_residual, v_window, exps, k_rollback, v_rollback)``: the arrays
        to append to the key groups and to the value rows (None when nothing is quantized), the
        new exact tokens, the exponents, and the rollback copies: the exact keys of the last
        ``ceil(rollback_tokens / chunk)`` quantized chunks and the last ``rollback_tokens``
        values that left the window (with a window; without one values need none).
        """
        xp = st.xp
        g, w = self.group_size, self.residual_window
        pdt = self._pdt(xp)
        (k, v), exps = self._normalized(st, k, v)
        edt = st.k_residual.dtype
        if k.dtype != edt:
            k, v = xp.astype(k, edt), xp.astype(v, edt)
        allk = xp.concat([st.k_residual, k], axis=2)
        b, h, n, d = (int(s) for s in allk.shape)
        chunk = w or g  # keys are quantized in whole chunks of the window (or of one group)
        full = n // chunk * (chunk // g)
        kq = None
        if full:
            blk = xp.reshape(allk[:, :, : full * g, :], (b, h, full, g, d))
            blk = xp.permute_dims(blk, (0, 1, 2, 4, 3))  # (b, h, groups, d, G): tokens last
            q = quantize_groups(blk, self.bits, g, param_dtype=pdt, exponent=0, **_INTQ_OPS)
            kq = {"k_codes": q.codes, "k_scale": q.scale[..., 0], "k_offset": q.offset[..., 0]}
        residual = xp.asarray(allk[:, :, full * g :, :], copy=True)
        k_copies = keep_last(xp, st.k_rollback, allk[:, :, : full * g, :], key_copies(self)) if full else st.k_rollback
        window = st.v_window
        if w == 0:
            spill, allv, new_window = int(v.shape[2]), v, window
        else:
            allv = xp.concat([window, v], axis=2)
            spill = max(0, int(allv.shape[2]) - w)
            new_window = xp.asarray(allv[:, :, spill:, :], copy=True)
        vq, v_copies = None, st.v_rollback
        if spill:
            qv = quantize_groups(allv[:, :, :spill, :], self.bits, g, param_dtype=pdt, exponent=0, **_INTQ_OPS)
            vq = {"v_codes": qv.codes, "v_scale": qv.scale, "v_offset": qv.offset}
            if w:
                v_copies = keep_last(xp, st.v_rollback, allv[:, :, :spill, :], self.rollback_tokens)
        return kq, vq, residual, new_window, exps, k_copies, v_copies

    def _normalized(self, st: IntLayer, k: Array, v: Array) -> tuple[list[Array], tuple[int | None, ...]]:
        """``(k / 2**k_exp, v / 2**v_exp)`` and the layer's exponents after this store.

        An exponent is fixed by the first store with non-zero data (:func:`half_exponent`);
        everything of the layer is kept in those units, so float16 scales and windows neither
        underflow nor overflow at any magnitude. A later store that would still overflow
        float16 is refused before anything changes.
        """
        xp = st.xp
        out, exps = [], []
        for name, x, e in (("k", k, st.exp[0]), ("v", v, st.exp[1])):
            m = float(xp.max(xp.abs(x)))
            if e is None and m > 0.0:
                e = half_exponent(m)
            if e:
                x = x * 2.0**-e
            if math.isfinite(m) and m * 2.0 ** -(e or 0) > HALF_MAX and self._holds_half(xp):
                raise ValueError(
                    f"{name} holds values up to {m:.4g}, beyond what this layer's float16 scales and exact "
                    f"tokens hold in the units its first tokens fixed (2**{e or 0}, largest |{name}| "
                    f"{HALF_MAX:g} · 2**{e or 0}); reset the cache, or use scale_dtype='float32' "
                    "and residual_window=0"
                )
            out.append(x)
            exps.append(e)
        return out, tuple(exps)

    def _holds_half(self, xp: Namespace) -> bool:
        """Whether a layer keeps anything in float16 (its scales, or its exact window)."""
        return hasattr(xp, "float16") and (self._pdt(xp) == "float16" or bool(self.residual_window))

    def _store(self, st: IntLayer, k: Array, v: Array, q: Array | None = None) -> None:
        kq, vq, residual, window, exps, k_copies, v_copies = self._encode(st, k, v)
        # Room in both buffers first: an allocation that fails leaves both as they were.
        if kq is not None:
            st.kq.reserve(kq)
        if vq is not None:
            st.vq.reserve(vq)
        # Commit (nothing below allocates).
        if kq is not None:
            st.kq.append(kq)
        if vq is not None:
            st.vq.append(vq)
        st.k_residual = residual
        st.v_window = window
        if exps != st.exp:  # this store fixed the layer's units: a cut inside it is refused
            st.fixed_end = st.length + int(k.shape[2])
        st.exp = exps
        st.k_rollback, st.v_rollback = k_copies, v_copies

    def _decoded(self, st: IntLayer, start: int = 0) -> DequantResult:
        """K/V of the stored tokens ``start ..`` (:func:`~arraykv.caches.int_decode.decode_int_layer`)."""
        return decode_int_layer(st, self.bits, self.group_size, bool(self.residual_window), start)

    # -- hooks ----------------------------------------------------------------------
    def _prefill(self, st: IntLayer, k: Array, v: Array, q: Array) -> DequantResult:
        self._store_tokens(st, k, v, q)
        return self._decoded(st)

    def _decode(self, st: IntLayer, k: Array, v: Array, q: Array, config: AttendConfig) -> Fused | Dequantized:
        self._store_tokens(st, k, v, q)
        if self._fused(st.xp):
            return Fused(ops.int_decode_attention(self._codec_state(st), q, config.softmax_scale))
        return Dequantized(self._decoded(st))

    def _fused_auto(self, xp: Namespace) -> bool:
        return self.bits in (2, 4, 8) and ops.has_kernel("int_decode_attention", xp)

    def _stable_length(self, st: IntLayer) -> int:
        # a key is final once its group is quantized, a value once it left the window
        return min(st.kq.length * self.group_size, st.vq.length)

    def _layer_arrays(self, st: IntLayer) -> dict[str, Array]:
        return layer_arrays(st, bool(self.residual_window))

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout:
        return int_layout(self, xp, batch, length, dtype, getattr(xp, self._pdt(xp)), self._exact_dtype(xp, dtype))

    def _restore_layer(
        self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
    ) -> IntLayer:
        st = restore_layer(self._new_layer(xp, dev, batch, dtype), arrays, length, self.group_size)
        exact = {"k": {"k_residual": st.k_residual, "k_rollback": st.k_rollback}, "v": {"v_rollback": st.v_rollback}}
        if self.residual_window:
            exact["v"]["v_window"] = st.v_window
        check_int_room(
            xp,
            exact=exact,
            exps=st.exp,
            half_params=self._pdt(xp) == "float16",
            half_output=dtype_name(dtype) == "float16",
        )
        return st

    def _side_nbytes(self, st: IntLayer) -> int:
        return _compat.array_nbytes(st.k_residual) + _compat.array_nbytes(st.v_window) + self._rollback_nbytes(st)

    def _rollback_nbytes(self, st: IntLayer) -> int:
        return _compat.array_nbytes(st.k_rollback) + _compat.array_nbytes(st.v_rollback) + RECORD_NBYTES

    def _truncate_floor(self, st: IntLayer) -> int:
        return truncate_floor(self, st)

    def _truncate_plan(self, st: IntLayer, length: int) -> Callable[[], None]:
        return truncate_plan(self, st, length)

    # -- inspection for kernels ------------------------------------------------------
    def layer_codec_state(self, layer: int) -> IntLayerCodec | None:
        """The arrays of ``layer`` as an :class:`IntLayerCodec` (views, not copies), or None if empty.

        Valid until the next call that changes the layer; read, never write.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        IntLayerCodec or None
            Everything a kernel needs to read the layer (views); None for an empty layer.
        """
        return self._with_layer(layer, self._codec_state)

    def _codec_state(self, st: IntLayer) -> IntLayerCodec:
        return codec_state(st, self.bits, self.group_size, getattr(st.xp, self._pdt(st.xp)))


class Int2Cache(IntQuantCache):
    """INT2 KIVI-style cache (KIVI-2: four codes per byte, a 32-token float16 residual); see :class:`IntQuantCache`."""

    method = "int2"
    bits = 2
    default_residual_window = 32


class Int4Cache(IntQuantCache):
    """INT4 KIVI-style cache (two codes per byte); see :class:`IntQuantCache`."""

    method = "int4"
    bits = 4


class Int8Cache(IntQuantCache):
    """INT8 KIVI-style cache; see :class:`IntQuantCache`."""

    method = "int8"
    bits = 8
