"""What the streaming ``lowrank`` and ``vq`` caches share: the fit, the sinks and the window.

Streaming caches built on the whole-tensor codecs of :mod:`arraykv.compressor`.

``lowrank``
    Every key and value is stored as its coefficients on a per-(layer, KV head) PCA basis:
    ``x ≈ mean + basis @ coef`` (:mod:`arraykv.quant.lowrank`).
``vq``
    Product quantization: every vector is split into sub-vectors of ``sub_dim`` channels, each
    stored as the index of its nearest centroid in a per-(layer, KV head, sub-space) k-means
    codebook (:mod:`arraykv.quant.vq`).

Both need a fitted model (basis or codebooks) per layer. It is either given (``calibration``:
a fitted :class:`~arraykv.KVCacheCompressor` or the fitted arrays) or fitted by the cache on
the tokens a layer holds the first time it holds enough of them (normally its first
prefill); until then the layer keeps its tokens in float16. After the fit, the latest
``residual_window`` tokens stay in float16 and older ones are encoded as they leave the
window. The arrays a layer holds, and the fitting rule, are in the class docstrings; a saved
layer is checked against them before it is rebuilt (:meth:`FittedCache._layer_layout`,
:mod:`arraykv.caches.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _compat
from .._types import Array, Device, DType, Namespace
from .._validation import check_int
from ..compressor import KVCacheCompressor
from ..protocol import AttendConfig, Dequantized, DequantResult, Fused
from ..quant.polar import half_dtype
from ..storage import TokenBuffers
from .base import LayeredCache, check_decode_path
from .layout import Layout, Spec, join
from .rollback import DEFAULT_ROLLBACK_TOKENS, check_rollback_tokens
from .window import (
    ExactTokens,
    WindowLayer,
    WindowRollback,
    commit_store,
    restore_rollback,
    restore_tokens,
    rollback_arrays,
    rollback_layout,
    token_counts,
)

__all__ = ["FittedCache", "FittedLayer", "DEFAULT_WINDOW", "DEFAULT_SINKS"]

#: Default float16 recent-token window and attention sinks of both caches. Measured on
#: SmolLM2-135M (512 tokens, prefill 64, rank 32 of 64): mean KL 2.17 with neither, 2.00 with
#: 4 sinks, 0.41 with a 20-token window, 0.26 with both, for +0.3 bits per value.
DEFAULT_WINDOW = 20
DEFAULT_SINKS = 4


def _to(xp: Namespace, dev: Device, a: Array) -> Array:
    """A copy of array ``a`` (any namespace) in namespace ``xp`` on device ``dev``."""
    if _compat.namespace(a) is xp:
        return xp.asarray(a, copy=True)
    return xp.asarray(_compat.to_numpy(a), device=dev)


def _f32(xp: Namespace, x: Array) -> Array:
    return x if x.dtype == xp.float32 else xp.astype(x, xp.float32)


@dataclass
class FittedLayer(WindowLayer):
    """One layer of a ``lowrank`` or ``vq`` cache (:class:`~arraykv.caches.window.WindowLayer`).

    ``codes`` holds the cache's ``_per_token`` arrays; ``exact`` holds every token until the
    layer is fitted; ``calib`` is the dict of fitted arrays by name (``_calib_names``): given,
    fitted, or loaded.

    Attributes
    ----------
    layer : int or None
        The layer index, set on the first call (-1 for a restored layer).
    """

    layer: int | None = None


class FittedCache(WindowRollback, LayeredCache[FittedLayer]):
    """What ``lowrank`` and ``vq`` share: the float16 window and the per-layer fit.

    Subclasses set ``_per_token`` (names of the per-token arrays), ``_calib_names`` and
    implement ``_convert(item)`` (a user calibration → arrays by name), ``_fit(xp, k, v)``,
    ``_encode(xp, calib, k, v)`` and ``_decode_tokens(xp, calib, buf, start)``.
    """

    _per_token: tuple = ()
    _calib_names: tuple = ()
    _item_kinds: tuple = ()
    #: Vectors per head the fit may use at most (None: all); see the ``vq`` option.
    max_calibration: int | None = None

    if TYPE_CHECKING:  # set or implemented by each subclass (see above)
        min_calibration: int

        def _item_help(self) -> str: ...
        def _convert(self, item: Any, where: str = "calibration") -> dict[str, Array]: ...
        def _fit(self, xp: Namespace, k: Array, v: Array) -> dict[str, Array]: ...
        def _encode(self, xp: Namespace, calib: dict[str, Array], k: Array, v: Array) -> dict[str, Array]: ...
        def _decode_tokens(
            self, xp: Namespace, calib: dict[str, Array], buf: TokenBuffers, start: int = 0
        ) -> tuple[Array, Array]: ...
        def _attend(self, st: FittedLayer, q: Array, scale: float) -> Array: ...

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        calibration: Any = None,
        residual_window: int = DEFAULT_WINDOW,
        sink_tokens: int = DEFAULT_SINKS,
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
        self.residual_window = check_int("residual_window", residual_window, low=0)
        self.sink_tokens = check_int("sink_tokens", sink_tokens, low=0)
        self.rollback_tokens = check_rollback_tokens(rollback_tokens)
        self.decode_path = check_decode_path(decode_path)
        self._given = self._check_calibration(calibration)

    # -- the user's calibration ---------------------------------------------------------
    def _check_calibration(self, calibration: Any) -> list[dict[str, Array] | None]:
        """One entry per layer: None (fit on the layer's tokens) or a dict of arrays."""
        if calibration is None:
            return [None] * self.num_layers
        if self._is_item(calibration):
            arrays = self._convert(calibration)
            return [arrays] * self.num_layers
        if isinstance(calibration, (list, tuple)):
            if len(calibration) != self.num_layers:
                raise ValueError(
                    f"calibration must be one fitted item for every layer or a sequence of num_layers="
                    f"{self.num_layers} items (None for a layer that fits its own), received a sequence of "
                    f"{len(calibration)}"
                )
            out: list[dict[str, Array] | None] = []
            for i, item in enumerate(calibration):
                if item is not None and not self._is_item(item):
                    raise TypeError(
                        f"calibration[{i}] must be {self._item_help()} or None, received {type(item).__name__}"
                    )
                out.append(None if item is None else self._convert(item, where=f"calibration[{i}]"))
            return out
        raise TypeError(
            f"calibration must be None, {self._item_help()}, or a sequence of num_layers of them, "
            f"received {type(calibration).__name__}"
        )

    def _is_item(self, x: object) -> bool:
        if isinstance(x, KVCacheCompressor):
            return True
        return isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(e, self._item_kinds) for e in x)

    def _pair(self, item: Any, method_type: type, where: str) -> tuple:
        """(k model, v model) of a fitted compressor or a pair."""
        if isinstance(item, KVCacheCompressor):
            if not isinstance(item.method, method_type):
                raise TypeError(
                    f"{where} must be a KVCacheCompressor with a {method_type.__name__} method, "
                    f"received one with {type(item.method).__name__}"
                )
            if not item.fitted:
                raise ValueError(f"{where} must be a fitted KVCacheCompressor (call fit(k, v) first)")
            return item.fitted_models()
        return item[0], item[1]

    def _check_heads(self, where: str, a: Array, what: str) -> None:
        """``a`` must be (num_kv_heads, head_dim, ...)."""
        shape = tuple(int(s) for s in a.shape)
        if shape[:2] != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"{where}: {what} must be for num_kv_heads={self.num_kv_heads} and "
                f"head_dim={self.head_dim}, received shape {shape}"
            )

    def _extra_config(self) -> dict[str, Any]:
        return {
            "min_calibration": self.min_calibration,
            "residual_window": self.residual_window,
            "sink_tokens": self.sink_tokens,
            "rollback_tokens": self.rollback_tokens,
            "decode_path": self.decode_path,
        }

    # -- layer state ----------------------------------------------------------------------
    def _new_layer(self, xp: Namespace, dev: Device, batch: int, dtype: DType) -> FittedLayer:
        empty = ExactTokens.empty(xp, dev, batch, self.num_kv_heads, self.head_dim)
        return FittedLayer(
            xp=xp,
            device=dev,
            batch=batch,
            dtype=dtype,
            codes=TokenBuffers(max_tokens=self.max_tokens),
            exact=empty,
            rollback=empty,
        )

    def _admit(self, layer: int, xp: Namespace, k: Array, v: Array, tokens: int) -> FittedLayer:
        st = super()._admit(layer, xp, k, v, tokens)
        if st.layer is None:  # a fresh layer: take the given calibration, if any
            st.layer = layer
            given = self._given[layer]
            if given is not None:
                st.calib = {n: _to(xp, st.device, a) for n, a in given.items()}
        return st

    def _store(self, st: FittedLayer, k: Array, v: Array, q: Array | None = None) -> None:
        """Append new tokens (everything computed first, then committed)."""
        xp = st.xp
        step = st.exact.step(xp, k, v, sink_tokens=self.sink_tokens)  # the first tokens stay exact, unfitted
        n = step.n_recent + step.n_new
        calib = st.calib
        if calib is None and st.batch * n >= self.min_calibration:
            # the first fit: on every token held so far (window, then the new ones)
            calib = self._fit(xp, *self._fit_sample(xp, *step.first(n)))
        spill = step.spill(self.residual_window) if calib is not None else 0
        arrays = None
        if spill:  # the oldest tokens of window + new leave the window: encode them
            arrays = self._encode(xp, calib, *step.first(spill))
        commit_store(
            xp, self.method, st, step, spill, arrays, calib, {} if calib is st.calib else calib, self.rollback_tokens
        )

    def _fit_sample(self, xp: Namespace, k: Array, v: Array) -> tuple[Array, Array]:
        """The tokens the fit sees: all of them, or ``max_calibration // batch`` evenly spaced ones."""
        cap = self.max_calibration
        b, n = int(k.shape[0]), int(k.shape[2])
        if cap is None or b * n <= cap:
            return k, v
        n_fit = max(1, cap // b)
        idx = xp.astype(xp.round(xp.linspace(0.0, float(n - 1), n_fit, device=_compat.device(k))), xp.int64)
        return xp.take(k, idx, axis=2), xp.take(v, idx, axis=2)

    def _decoded(self, st: FittedLayer, start: int = 0) -> DequantResult:
        """K/V of the stored tokens ``start ..`` in the layer's dtype: sinks, encoded tokens, window."""
        xp = st.xp
        buf = st.codes
        n_s = st.exact.n_sink
        c0 = min(max(0, start - n_s), buf.length)
        w0 = max(0, start - n_s - buf.length)
        (ks, vs), (kw, vw) = st.exact.sinks(), st.exact.recent()
        ks, vs = ks[:, :, min(start, n_s) :, :], vs[:, :, min(start, n_s) :, :]
        kw, vw = kw[:, :, w0:, :], vw[:, :, w0:, :]
        if buf.length > c0:
            kd, vd = self._decode_tokens(xp, st.calib, buf, c0)
            pk = [_f32(xp, ks), kd, _f32(xp, kw)]
            pv = [_f32(xp, vs), vd, _f32(xp, vw)]
        else:
            pk, pv = [ks, kw], [vs, vw]
        pk = [a for a in pk if int(a.shape[2])] or pk[:1]
        pv = [a for a in pv if int(a.shape[2])] or pv[:1]
        kd = pk[0] if len(pk) == 1 else xp.concat(pk, axis=2)
        vd = pv[0] if len(pv) == 1 else xp.concat(pv, axis=2)
        return DequantResult(k=xp.astype(kd, st.dtype), v=xp.astype(vd, st.dtype))

    # -- hooks ----------------------------------------------------------------------------
    def _prefill(self, st: FittedLayer, k: Array, v: Array, q: Array) -> DequantResult:
        first = st.length == 0
        self._store_tokens(st, k, v, q)
        if first:
            return DequantResult(k=k, v=v)
        return self._decoded(st)

    def _decode(self, st: FittedLayer, k: Array, v: Array, q: Array, config: AttendConfig) -> Fused | Dequantized:
        self._store_tokens(st, k, v, q)
        if self._fused(st.xp):
            return Fused(self._attend(st, q, config.softmax_scale))
        return Dequantized(self._decoded(st))

    def _extras(self, st: FittedLayer) -> tuple[Array, Array]:
        """The tokens kept as float16 vectors (sinks, then window): (b, h, E, d) each."""
        return st.exact.k, st.exact.v

    def _uncalibrated_at(self, st: FittedLayer, length: int) -> bool:
        # a layer fits once it holds min_calibration vectors per head besides its sinks (none if given)
        return st.batch * (length - min(self.sink_tokens, length)) < self.min_calibration

    def _stable_length(self, st: FittedLayer) -> int:
        # sinks and encoded tokens never change; window tokens (all tokens before the fit) will be encoded
        return st.exact.n_sink + st.codes.length

    # -- persistence view: sinks and window saved apart (k_sink, k_window, ...), codes, fit ------
    def _layer_arrays(self, st: FittedLayer) -> dict[str, Array]:
        out = dict(st.codes.arrays())
        (out["k_sink"], out["v_sink"]), (out["k_window"], out["v_window"]) = st.exact.sinks(), st.exact.recent()
        if st.calib is not None:
            out.update(st.calib)
        out.update(rollback_arrays(st))
        return out

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout:
        """The saved arrays of a layer: the fit (:meth:`_fit_layout`), the encoded tokens
        (:meth:`_token_specs`, token axis ``"codes"``), the float16 sinks and window and the
        rollback state, with the token counts of :func:`~arraykv.caches.window.token_counts`
        (a fit given or made: the arrays of the fit are held)."""
        b, h, d = batch, self.num_kv_heads, self.head_dim
        half = half_dtype(xp)
        exact = {
            "k_sink": Spec(half, (b, h, "sinks", d)),
            "v_sink": Spec(half, (b, h, "sinks", d)),
            "k_window": Spec(half, (b, h, "window", d)),
            "v_window": Spec(half, (b, h, "window", d)),
        }
        tokens = self._token_specs(xp, b)
        fit = self._fit_layout(xp)

        def counts(sizes: dict[str, int], held: frozenset[str]) -> str | None:
            return token_counts(
                self,
                length,
                sizes["sinks"],
                sizes["window"],
                sizes.get("codes", 0),
                sizes.get("copies", 0),
                self._calib_names[0] in held,
                spill_calibrates=False,
            )

        parts = Layout(arrays={**tokens, **exact}, groups=(tuple(tokens), self._calib_names))
        return join(fit, parts, rollback_layout(xp, b, h, d), sizes={"length": length}, rules=(counts,))

    def _fit_layout(self, xp: Namespace) -> Layout:
        """The :class:`~arraykv.caches.layout.Layout` of the fitted arrays (all optional: a layer
        not fitted yet holds none)."""
        raise NotImplementedError

    def _token_specs(self, xp: Namespace, batch: int) -> dict[str, Spec]:
        """The :class:`~arraykv.caches.layout.Spec` of each per-token array, token axis ``"codes"``."""
        raise NotImplementedError

    def _restore_layer(
        self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
    ) -> FittedLayer:
        st = self._new_layer(xp, dev, batch, dtype)
        parts = [xp.asarray(arrays[n], copy=True) for n in ("k_sink", "v_sink", "k_window", "v_window")]
        restore_tokens(st, arrays, self._per_token, ExactTokens.from_parts(xp, *parts), length)
        if all(n in arrays for n in self._calib_names):
            st.calib = {n: xp.asarray(arrays[n], copy=True) for n in self._calib_names}
        elif st.codes.length:
            raise ValueError("stored arrays hold encoded tokens but no fitted basis/codebooks")
        st.layer = -1  # restored: the file's calibration, not the constructor's
        restore_rollback(st, arrays)
        self._check_room(st)
        return st

    def _check_room(self, st: FittedLayer) -> None:
        """Refuse a restored layer that leaves no float16 room for its window or the next token
        (``ValueError`` naming the array; :mod:`arraykv.caches.restore_checks`). Each codec its own."""

    def _side_nbytes(self, st: FittedLayer) -> int:
        total = st.exact.nbytes() + self._rollback_nbytes(st)
        if st.calib is not None:
            total += sum(_compat.array_nbytes(a) for a in st.calib.values())
        return total

    def is_fitted(self, layer: int) -> bool:
        """Whether ``layer`` holds its basis/codebooks (given, fitted, or loaded).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        bool
            False for an empty layer, or one not fitted yet.
        """
        return bool(self._with_layer(layer, lambda st: st.calib is not None))
