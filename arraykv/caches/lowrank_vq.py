"""Streaming caches built on the whole-tensor codecs of :mod:`arraykv.compressor`.

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
window. The arrays a layer holds, and the fitting rule, are in the class docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._validation import check_bool, check_int
from ..compressor import KVCacheCompressor, LowRank, VectorQuantization, samples_by_head
from ..attention.lowrank_fused import lowrank_decode_attention
from ..attention.reference import attention
from .. import ops
from ..protocol import AttendConfig, Dequantized, DequantResult, Fused
from ..quant.polar import half_dtype
from ..quant.lowrank import LowRankBasis, check_rank_energy, fit_basis
from ..quant.vq import VQCodebook, VQCodes, check_vq_options, code_bits, train_vq, vq_decode, vq_encode
from ..storage import TokenBuffers
from .base import LayeredCache, LayerState, check_decode_path, refuse_overflow
from .registry import register_method
from .window import ExactTokens

__all__ = ["LowRankCache", "VQCache", "FittedLayer"]

_COEFF_DTYPES = ("float16", "float32")
#: Default float16 recent-token window and attention sinks of both caches. Measured on
#: SmolLM2-135M (512 tokens, prefill 64, rank 32 of 64): mean KL 2.17 with neither, 2.00 with
#: 4 sinks, 0.41 with a 20-token window, 0.26 with both, for +0.3 bits per value.
DEFAULT_WINDOW = 20
DEFAULT_SINKS = 4
#: ``vq`` fits its codebooks once it holds this many vectors per centroid (per head).
VQ_VECTORS_PER_CENTROID = 4
#: ... and on at most this many per centroid (an evenly spaced subsample of a long prefill):
#: k-means costs O(vectors · K · iterations), 22 s per side for 8 heads × 32k tokens × d 128 at
#: K = 16 on this 2-core machine if every vector is used, 0.7 s with 64 per centroid.
VQ_FIT_VECTORS_PER_CENTROID = 64


def _to(xp: Any, dev: Any, a: Any):
    """A copy of array ``a`` (any namespace) in namespace ``xp`` on device ``dev``."""
    if _compat.namespace(a) is xp:
        return xp.asarray(a, copy=True)
    return xp.asarray(_compat.to_numpy(a), device=dev)


def _f32(xp: Any, x: Any):
    return x if x.dtype == xp.float32 else xp.astype(x, xp.float32)


@dataclass
class FittedLayer(LayerState):
    """One layer of a ``lowrank`` or ``vq`` cache.

    Attributes
    ----------
    codes : TokenBuffers
        The encoded tokens' arrays (the cache's ``_per_token`` names), token axis 2.
    exact : ExactTokens
        The sink tokens, then the recent window (all tokens until the layer is fitted), float16.
    calib : dict or None
        The fitted arrays by name (``_calib_names``): given, fitted, or loaded.
    layer : int or None
        The layer index, set on the first call (-1 for a restored layer).
    """

    codes: TokenBuffers = None
    exact: ExactTokens = None
    calib: dict | None = None
    layer: int | None = None

    def buffers(self) -> tuple:
        return (self.codes,)


class _CalibratedCache(LayeredCache):
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

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, calibration: Any = None,
                 residual_window: int = DEFAULT_WINDOW, sink_tokens: int = DEFAULT_SINKS,
                 decode_path: str = "auto", check_finite: bool = True, max_tokens: int | None = None):
        super().__init__(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         check_finite=check_finite, max_tokens=max_tokens)
        self.residual_window = check_int("residual_window", residual_window, low=0)
        self.sink_tokens = check_int("sink_tokens", sink_tokens, low=0)
        self.decode_path = check_decode_path(decode_path)
        self._given = self._check_calibration(calibration)

    # -- the user's calibration ---------------------------------------------------------
    def _check_calibration(self, calibration: Any) -> list:
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
            out = []
            for i, item in enumerate(calibration):
                if item is not None and not self._is_item(item):
                    raise TypeError(f"calibration[{i}] must be {self._item_help()} or None, "
                                    f"received {type(item).__name__}")
                out.append(None if item is None else self._convert(item, where=f"calibration[{i}]"))
            return out
        raise TypeError(f"calibration must be None, {self._item_help()}, or a sequence of num_layers of them, "
                        f"received {type(calibration).__name__}")

    def _is_item(self, x: Any) -> bool:
        if isinstance(x, KVCacheCompressor):
            return True
        return isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(e, self._item_kinds) for e in x)

    def _pair(self, item: Any, method_type: type, where: str) -> tuple:
        """(k model, v model) of a fitted compressor or a pair."""
        if isinstance(item, KVCacheCompressor):
            if not isinstance(item.method, method_type):
                raise TypeError(f"{where} must be a KVCacheCompressor with a {method_type.__name__} method, "
                                f"received one with {type(item.method).__name__}")
            if not item.fitted:
                raise ValueError(f"{where} must be a fitted KVCacheCompressor (call fit(k, v) first)")
            return item.fitted_models()
        return item[0], item[1]

    def _check_heads(self, where: str, a: Any, what: str) -> None:
        """``a`` must be (num_kv_heads, head_dim, ...)."""
        shape = tuple(int(s) for s in a.shape)
        if shape[:2] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"{where}: {what} must be for num_kv_heads={self.num_kv_heads} and "
                             f"head_dim={self.head_dim}, received shape {shape}")

    def _extra_config(self) -> dict:
        return {"min_calibration": self.min_calibration, "residual_window": self.residual_window,
                "sink_tokens": self.sink_tokens, "decode_path": self.decode_path}

    # -- layer state ----------------------------------------------------------------------
    def _new_layer(self, xp, dev, batch, dtype) -> FittedLayer:
        return FittedLayer(xp=xp, device=dev, batch=batch, dtype=dtype, codes=TokenBuffers(max_tokens=self.max_tokens),
                           exact=ExactTokens.empty(xp, dev, batch, self.num_kv_heads, self.head_dim))

    def _admit(self, layer, xp, k, v, tokens):
        st = super()._admit(layer, xp, k, v, tokens)
        if st.layer is None:  # a fresh layer: take the given calibration, if any
            st.layer = layer
            given = self._given[layer]
            if given is not None:
                st.calib = {n: _to(xp, st.device, a) for n, a in given.items()}
        return st

    def _store(self, st: FittedLayer, k: Any, v: Any) -> None:
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
        exact = step.block(spill)
        refuse_overflow(xp, self.method, {"window": exact.k, "value window": exact.v, **(arrays or {}),
                                          **({} if calib is st.calib else calib)})
        # Commit.
        if arrays is not None:
            st.codes.append(arrays)
        st.calib = calib
        st.exact = exact

    def _fit_sample(self, xp: Any, k: Any, v: Any) -> tuple:
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
        ks, vs = ks[:, :, min(start, n_s):, :], vs[:, :, min(start, n_s):, :]
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
    def _prefill(self, st, k, v, q):
        first = st.length == 0
        self._store(st, k, v)
        if first:
            return DequantResult(k=k, v=v)
        return self._decoded(st)

    def _decode(self, st, k, v, q, config: AttendConfig):
        self._store(st, k, v)
        if self._fused(st.xp):
            return Fused(self._attend(st, q, config.softmax_scale))
        return Dequantized(self._decoded(st))

    def _extras(self, st: FittedLayer) -> tuple:
        """The tokens kept as float16 vectors (sinks, then window): (b, h, E, d) each."""
        return st.exact.k, st.exact.v

    def _dequantize(self, st) -> DequantResult:
        return self._decoded(st)

    def _dequantize_from(self, st, start: int) -> DequantResult:
        return self._decoded(st, start)

    def _append_tokens(self, st, k, v, q) -> None:
        self._store(st, k, v)

    def _stable_length(self, st) -> int:
        # sinks and encoded tokens never change; window tokens (all tokens before the fit) will be encoded
        return st.exact.n_sink + st.codes.length

    # -- persistence view: sinks and window saved apart (k_sink, k_window, ...), codes, fit ------
    def _layer_arrays(self, st) -> dict:
        out = dict(st.codes.arrays())
        (out["k_sink"], out["v_sink"]), (out["k_window"], out["v_window"]) = st.exact.sinks(), st.exact.recent()
        if st.calib is not None:
            out.update(st.calib)
        return out

    def _restore_layer(self, xp, dev, batch, dtype, length, arrays) -> FittedLayer:
        st = self._new_layer(xp, dev, batch, dtype)
        per_token = {n: arrays[n] for n in self._per_token if n in arrays}
        if per_token and int(next(iter(per_token.values())).shape[2]):
            st.codes.append(per_token)
        parts = [xp.asarray(arrays[n], copy=True) for n in ("k_sink", "v_sink", "k_window", "v_window")]
        st.exact = ExactTokens.from_parts(xp, *parts)
        if all(n in arrays for n in self._calib_names):
            st.calib = {n: xp.asarray(arrays[n], copy=True) for n in self._calib_names}
        elif st.codes.length:
            raise ValueError("stored arrays hold encoded tokens but no fitted basis/codebooks")
        st.layer = -1  # restored: the file's calibration, not the constructor's
        held = st.codes.length + st.exact.count
        if held != length:
            raise ValueError(f"stored arrays hold {held} tokens, expected {length}")
        st.length = length
        return st

    def _side_nbytes(self, st) -> int:
        total = st.exact.nbytes()
        if st.calib is not None:
            total += sum(_compat.array_nbytes(a) for a in st.calib.values())
        return total

    def _layer_nbytes(self, st) -> int:
        return st.codes.used_nbytes() + self._side_nbytes(st)

    def _layer_reserved_nbytes(self, st) -> int:
        return st.codes.reserved_nbytes() + self._side_nbytes(st)

    def is_fitted(self, layer: int) -> bool:
        """Whether ``layer`` holds its basis/codebooks (given, fitted, or loaded)."""
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            return st is not None and st.calib is not None


@register_method("lowrank")
class LowRankCache(_CalibratedCache):
    """Keys and values stored as coefficients on a per-(layer, KV head) PCA basis.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, check_finite, max_tokens
        As for every cache (:class:`~arraykv.caches.LayeredCache`).
    rank : int, optional
        Principal directions kept per head, ``1 <= rank <= head_dim``. Default ``head_dim // 2``
        (at least 1) when ``energy`` is not given either.
    energy : float, optional
        Keep the fewest directions holding at least this fraction of the calibration variance
        (``0 < energy <= 1``; the largest such rank over the heads, separately for keys and
        values). Give ``rank`` or ``energy``, not both.
    center : bool, default True
        Subtract the per-head mean of the calibration vectors first (PCA); ``False`` fits the
        uncentred SVD basis and stores a zero mean.
    coeff_dtype : {"float16", "float32"}, default "float16"
        Dtype of the stored coefficients. Namespaces without float16 (``array_api_strict``)
        store float32.
    calibration : optional
        Bases given by the user instead of fitted by the cache: a fitted
        :class:`~arraykv.KVCacheCompressor` with a :class:`~arraykv.LowRank` method, or a pair
        ``(k_basis, v_basis)`` of :class:`~arraykv.quant.lowrank.LowRankBasis` (heads =
        ``num_kv_heads``, head_dim = ``head_dim``), used for every layer; or a sequence of
        ``num_layers`` such items, ``None`` for a layer that fits its own. Its rank wins over
        ``rank``/``energy``.
    min_calibration : int, optional
        Vectors per head (``batch × tokens``) a layer must hold before it fits its basis; until
        then its tokens are kept in float16. Default ``head_dim`` (fewer vectors leave the
        sample covariance singular: the directions beyond their span would be arbitrary).
        At least 2.
    residual_window : int, default 20
        Latest tokens kept in float16 after the fit; older tokens are projected as they
        leave the window.
    sink_tokens : int, default 4
        The first tokens of the sequence, kept in float16 for good and left out of the fit
        (attention sinks).
    decode_path : {"auto", "fused", "dequantized"}, default "auto"
        ``"auto"`` and ``"fused"``: ``decode`` attends in coefficient space and returns
        :class:`~arraykv.Fused` (:func:`arraykv.attention.lowrank_fused.lowrank_decode_attention`,
        array-API matrix products, on every namespace); ``"dequantized"`` reconstructs the
        layer and returns :class:`~arraykv.Dequantized`.

    Notes
    -----
    State of a layer (``b`` batch, ``h`` heads, ``d`` head_dim, ``r`` rank, ``W`` window):

    ``k_coef``, ``v_coef`` (b, h, tokens, r_k / r_v), ``coeff_dtype``
        ``c = Vᵣᵀ (x − μ)`` of every encoded token.
    ``k_basis``, ``v_basis`` (h, d, r) float32; ``k_mean``, ``v_mean`` (h, d) float32
        ``Vᵣ`` (orthonormal columns) and ``μ`` of each head.
    ``k_window``, ``v_window`` (b, h, n, d) float16
        The tokens not encoded: all of them before the fit, the latest ``≤ W`` after.
    ``k_sink``, ``v_sink`` (b, h, ≤ sink_tokens, d) float16
        The first tokens of the sequence.

    A token is decoded as ``x̂ = μ + Vᵣ c``. For the calibration vectors ``X`` (centred
    covariance ``C = V Λ Vᵀ``) this is the best rank-``r`` affine approximation
    (Eckart–Young–Mirsky), with mean squared error ``Σ_{i>r} λ_i`` per vector; a token unlike
    the calibration tokens loses whatever part of it lies outside the span of ``Vᵣ``.
    With float16 coefficients a value costs ``16 r / d`` bits (8 at ``r = d/2``), plus the
    basis and mean, ``32 (d r + d)`` bits per head for keys and again for values, and the
    window. The fit is :func:`arraykv.quant.lowrank.fit_basis` on the layer's tokens when it
    first holds ``min_calibration`` vectors per head (the first prefill, normally), the very
    fit of ``KVCacheCompressor(LowRank(rank)).fit(k, v)`` on those tokens; the first prefill
    returns its exact K/V. ``decode`` scores the query against the coefficients
    (``q·x̂ = q·μ + (Vᵣᵀq)·c``) and sums the values in coefficient space, so a step costs
    ``O(tokens · r)`` per query head rather than the ``O(tokens · r · d)`` of reconstructing.
    On SmolLM2-135M the float16 window and the sinks matter most: without them (rank 32 of
    64) the mean KL is 2.17, with them 0.26, and 0.16 with a basis fitted on another text
    (``calibration``); see ``docs/quality.md``.

    :meth:`get_config` leaves ``calibration`` out (arrays are not configuration); a saved
    cache stores each non-empty layer's basis with the layer, so a loaded cache continues
    exactly, while its empty layers (and every layer after :meth:`reset`) fit their own.
    """

    method = "lowrank"
    _per_token = ("k_coef", "v_coef")
    _calib_names = ("k_basis", "k_mean", "v_basis", "v_mean")
    _item_kinds = (LowRankBasis,)

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, rank: int | None = None,
                 energy: float | None = None, center: bool = True, coeff_dtype: str = "float16",
                 calibration: Any = None, min_calibration: int | None = None, residual_window: int = DEFAULT_WINDOW,
                 sink_tokens: int = DEFAULT_SINKS, decode_path: str = "auto", check_finite: bool = True,
                 max_tokens: int | None = None):
        d = check_int("head_dim", head_dim, low=1)
        if rank is None and energy is None:
            rank = max(1, d // 2)
        self.rank, self.energy = check_rank_energy(rank, energy, d)
        self.center = check_bool("center", center)
        if not isinstance(coeff_dtype, str) or coeff_dtype not in _COEFF_DTYPES:
            raise ValueError(f"coeff_dtype must be one of {', '.join(_COEFF_DTYPES)}, received {coeff_dtype!r}")
        self.coeff_dtype = coeff_dtype
        self.min_calibration = d if min_calibration is None else check_int("min_calibration", min_calibration,
                                                                           low=2)
        super().__init__(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         calibration=calibration, residual_window=residual_window, sink_tokens=sink_tokens,
                         decode_path=decode_path, check_finite=check_finite, max_tokens=max_tokens)

    def _extra_config(self) -> dict:
        return super()._extra_config() | {"rank": self.rank, "energy": self.energy, "center": self.center,
                                          "coeff_dtype": self.coeff_dtype}

    def _item_help(self) -> str:
        return "a fitted KVCacheCompressor(LowRank(...)) or a pair (k_basis, v_basis) of LowRankBasis"

    def _convert(self, item: Any, where: str = "calibration") -> dict:
        out = {}
        for name, b in zip(("k", "v"), self._pair(item, LowRank, where)):
            if not isinstance(b, LowRankBasis):
                raise TypeError(f"{where} must hold LowRankBasis, received {type(b).__name__}")
            if b.basis.ndim != 3:
                raise ValueError(f"{where}: the {name} basis must be (heads, head_dim, rank), "
                                 f"received shape {tuple(int(s) for s in b.basis.shape)}")
            self._check_heads(where, b.basis, f"the {name} basis")
            xp = _compat.namespace(b.basis)
            out[f"{name}_basis"] = xp.asarray(_f32(xp, b.basis), copy=True)
            if b.mean is None:
                out[f"{name}_mean"] = xp.zeros((self.num_kv_heads, self.head_dim), dtype=xp.float32,
                                              device=_compat.device(b.basis))
            else:
                self._check_heads(where, b.mean, f"the {name} mean")
                out[f"{name}_mean"] = xp.asarray(_f32(xp, b.mean), copy=True)
        return out

    def _cdt(self, xp: Any):
        return xp.float32 if self.coeff_dtype == "float32" else half_dtype(xp)

    def _fit(self, xp, k, v) -> dict:
        out = {}
        for name, x in (("k", k), ("v", v)):
            b = fit_basis(samples_by_head(xp, x), rank=self.rank, energy=self.energy, center=self.center)
            out[f"{name}_basis"] = b.basis
            out[f"{name}_mean"] = b.mean if b.mean is not None else xp.zeros(
                (self.num_kv_heads, self.head_dim), dtype=xp.float32, device=_compat.device(x))
        return out

    def _encode(self, xp, calib, k, v) -> dict:
        cdt = self._cdt(xp)
        out = {}
        for name, x in (("k", k), ("v", v)):
            c = xp.matmul(x - calib[f"{name}_mean"][:, None, :], calib[f"{name}_basis"])
            out[f"{name}_coef"] = c if c.dtype == cdt else xp.astype(c, cdt)
        return out

    def _fused_auto(self, xp: Any) -> bool:
        return True  # matrix products in coefficient space: cheaper than reconstructing, everywhere

    def _attend(self, st: FittedLayer, q: Any, scale: float):
        buf, calib = st.codes, st.calib
        ke, ve = self._extras(st)
        if calib is None or not buf.length:
            return lowrank_decode_attention(q, ke[:, :, :0, :], None, None, ve[:, :, :0, :], None, None, ke, ve,
                                            softmax_scale=scale)
        return lowrank_decode_attention(q, buf.view("k_coef"), calib["k_basis"], calib["k_mean"], buf.view("v_coef"),
                                        calib["v_basis"], calib["v_mean"], ke, ve, softmax_scale=scale)

    def _decode_tokens(self, xp, calib, buf: TokenBuffers, start: int = 0) -> tuple:
        out = []
        for name in ("k", "v"):
            c = _f32(xp, buf.view(f"{name}_coef")[:, :, start:, :])
            out.append(xp.matmul(c, xp.matrix_transpose(calib[f"{name}_basis"])) + calib[f"{name}_mean"][:, None, :])
        return out[0], out[1]


@register_method("vq")
class VQCache(_CalibratedCache):
    """Keys and values stored as product-quantization codes on per-(layer, KV head) codebooks.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, check_finite, max_tokens
        As for every cache (:class:`~arraykv.caches.LayeredCache`).
    codebook_size : int, default 16
        Centroids per (head, sub-space), 2 to 65536; a code takes ``ceil(log2(codebook_size))``
        bits (codes of up to 8 bits are packed into uint8, two per byte at 4 bits; uint16 above).
    sub_dim : int, default 2
        Channels per sub-vector; must divide ``head_dim``. Bits per value of the codes:
        ``ceil(log2(codebook_size)) / sub_dim`` (2 at the defaults).
    max_iter, tol, seed
        Lloyd iterations at most, relative objective decrease that stops them, seed of the
        k-means++ draws (as :class:`~arraykv.VectorQuantization`).
    calibration : optional
        Codebooks given by the user instead of trained by the cache: a fitted
        :class:`~arraykv.KVCacheCompressor` with a :class:`~arraykv.VectorQuantization`
        method, or a pair ``(k_codebook, v_codebook)`` of :class:`~arraykv.quant.vq.VQCodebook`
        (heads = ``num_kv_heads``, sub-spaces × sub_dim = ``head_dim``), used for every layer;
        or a sequence of ``num_layers`` such items, ``None`` for a layer that trains its own.
        Its codebook size and sub_dim win over the options.
    min_calibration : int, optional
        Vectors per head (``batch × tokens``) a layer must hold before it trains its codebooks;
        until then its tokens are kept in float16. Default ``4 × codebook_size``; at least
        ``codebook_size`` (k-means with more centroids than training vectors is degenerate, the
        rule of :class:`~arraykv.KVCacheCompressor`).
    max_calibration : int, optional
        Vectors per head the k-means fit uses at most: a longer first prefill is subsampled
        (evenly spaced tokens, every batch row). Default ``max(64 × codebook_size,
        min_calibration)``; at least ``min_calibration``.
    residual_window : int, default 20
        Latest tokens kept in float16 after the fit; older tokens are encoded as they leave
        the window.
    sink_tokens : int, default 4
        The first tokens of the sequence, kept in float16 for good and left out of the fit.
    decode_path : {"auto", "fused", "dequantized"}, default "auto"
        ``"auto"``: ``decode`` attends straight from the codes and returns
        :class:`~arraykv.Fused` where a kernel exists for the namespace (Numba on NumPy), else
        it returns :class:`~arraykv.Dequantized`; ``"fused"`` always attends itself (the
        array-API :func:`~arraykv.attention.vq_fused.vq_decode_attention_reference` where no kernel
        exists); ``"dequantized"`` always reconstructs the layer.

    Notes
    -----
    State of a layer (``b`` batch, ``h`` heads, ``d`` head_dim, ``m = d / sub_dim`` sub-spaces,
    ``K`` codebook size, ``β = ceil(log2 K)``):

    ``k_codes``, ``v_codes`` (b, h, tokens, ceil(m β / 8)) uint8, or (b, h, tokens, m) uint16 when ``β > 8``
        The centroid index of every sub-vector, packed by :func:`arraykv.quant.bitpack.pack_bits`.
    ``k_centroids``, ``v_centroids`` (h, m, K, sub_dim) float32
        The codebooks.
    ``k_window``, ``v_window`` (b, h, n, d) float16
        The tokens not encoded: all of them before the fit, the latest ``≤ residual_window`` after.
    ``k_sink``, ``v_sink`` (b, h, ≤ sink_tokens, d) float16
        The first tokens of the sequence.

    Product quantization (Jégou, Douze & Schmid, 2011) stores ``x`` as the indices
    ``a_j = argmin_c ‖x_j − c‖`` of its sub-vectors ``x_j`` and decodes
    ``x̂ = [c_{a_1}, …, c_{a_m}]``; each codebook minimises ``Σ ‖x_j − c_{a(j)}‖²`` over the
    calibration vectors by Lloyd's algorithm from a k-means++ start
    (:func:`arraykv.quant.vq.train_vq`). A value costs ``β / sub_dim`` bits of codes plus the
    codebooks, ``32 K d`` bits per head for keys and again for values. The fit runs when a
    layer first holds ``min_calibration`` vectors per head (its first prefill, normally) on all
    of them (up to ``max_calibration``), exactly as
    ``KVCacheCompressor(VectorQuantization(...)).fit(k, v)`` on the same tokens; the first
    prefill returns its exact K/V. ``decode`` (fused) scores a query by
    asymmetric distance computation: a table ``T[j, k] = q_j · c_{jk}`` per query head, then
    ``q·x̂_t = Σ_j T[j, a_tj]``, and sums the values as per-sub-space histograms of the
    softmax weights over the centroids; nothing of the size of K or V is formed.

    :meth:`get_config` leaves ``calibration`` out; a saved cache stores each non-empty layer's
    codebooks with the layer (see :class:`LowRankCache`).
    """

    method = "vq"
    _per_token = ("k_codes", "v_codes")
    _calib_names = ("k_centroids", "v_centroids")
    _item_kinds = (VQCodebook,)

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, codebook_size: int = 16,
                 sub_dim: int = 2, max_iter: int = 25, tol: float = 1e-4, seed: int = 0, calibration: Any = None,
                 min_calibration: int | None = None, max_calibration: int | None = None,
                 residual_window: int = DEFAULT_WINDOW, sink_tokens: int = DEFAULT_SINKS, decode_path: str = "auto",
                 check_finite: bool = True, max_tokens: int | None = None):
        d = check_int("head_dim", head_dim, low=1)
        self.codebook_size, self.sub_dim, self.max_iter, self.tol = check_vq_options(
            codebook_size, sub_dim, d, max_iter, tol)
        self.seed = check_int("seed", seed, low=0)
        if min_calibration is None:
            min_calibration = VQ_VECTORS_PER_CENTROID * self.codebook_size
        self.min_calibration = check_int("min_calibration", min_calibration, low=self.codebook_size)
        if max_calibration is None:
            max_calibration = max(VQ_FIT_VECTORS_PER_CENTROID * self.codebook_size, self.min_calibration)
        self.max_calibration = check_int("max_calibration", max_calibration, low=self.min_calibration)
        super().__init__(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         calibration=calibration, residual_window=residual_window, sink_tokens=sink_tokens,
                         decode_path=decode_path, check_finite=check_finite, max_tokens=max_tokens)

    def _item_help(self) -> str:
        return "a fitted KVCacheCompressor(VectorQuantization(...)) or a pair (k_codebook, v_codebook) of VQCodebook"

    def _convert(self, item: Any, where: str = "calibration") -> dict:
        out = {}
        for name, cb in zip(("k", "v"), self._pair(item, VectorQuantization, where)):
            if not isinstance(cb, VQCodebook):
                raise TypeError(f"{where} must hold VQCodebook, received {type(cb).__name__}")
            c = cb.centroids
            if c.ndim != 4 or int(c.shape[0]) != self.num_kv_heads or cb.subspaces * cb.sub_dim != self.head_dim:
                raise ValueError(f"{where}: the {name} codebook must be (num_kv_heads={self.num_kv_heads}, "
                                 f"subspaces, codebook_size, sub_dim) with subspaces × sub_dim = head_dim="
                                 f"{self.head_dim}, received shape {tuple(int(s) for s in c.shape)}")
            xp = _compat.namespace(c)
            out[f"{name}_centroids"] = xp.asarray(_f32(xp, c), copy=True)
        return out

    def _extra_config(self) -> dict:
        return super()._extra_config() | {"codebook_size": self.codebook_size, "sub_dim": self.sub_dim,
                                          "max_iter": self.max_iter, "tol": self.tol, "seed": self.seed,
                                          "max_calibration": self.max_calibration}

    def _fit(self, xp, k, v) -> dict:
        return {f"{name}_centroids": train_vq(samples_by_head(xp, x), codebook_size=self.codebook_size,
                                              sub_dim=self.sub_dim, max_iter=self.max_iter, tol=self.tol,
                                              seed=self.seed, assign=ops.vq_assign, update=ops.vq_update).centroids
                for name, x in (("k", k), ("v", v))}

    def _encode(self, xp, calib, k, v) -> dict:
        return {f"{name}_codes": vq_encode(x, VQCodebook(centroids=calib[f"{name}_centroids"]), encode=ops.vq_encode).codes
                for name, x in (("k", k), ("v", v))}

    def _fused_auto(self, xp: Any) -> bool:
        return ops.has_kernel("vq_decode_attention", xp)

    def _attend(self, st: FittedLayer, q: Any, scale: float):
        xp, buf, calib = st.xp, st.codes, st.calib
        ke, ve = self._extras(st)
        if calib is None or not buf.length:
            return attention(q, ke, ve, softmax_scale=scale, causal=False)
        kc, vc = calib["k_centroids"], calib["v_centroids"]
        bits = code_bits(int(kc.shape[2]))
        if bits != code_bits(int(vc.shape[2])):  # given codebooks of different sizes: one code width per call
            r = self._decoded(st)
            return attention(q, r.k, r.v, softmax_scale=scale, causal=False)
        b, hq, _, d = (int(s) for s in q.shape)
        out = ops.vq_decode_attention(xp.reshape(q, (b, hq, d)), buf.view("k_codes"), kc, buf.view("v_codes"), vc, ke, ve,
                   bits=bits, softmax_scale=scale)
        out = xp.reshape(out, (b, hq, 1, d))
        return out if out.dtype == q.dtype else xp.astype(out, q.dtype)

    def _decode_tokens(self, xp, calib, buf: TokenBuffers, start: int = 0) -> tuple:
        out = []
        for name in ("k", "v"):
            cb = VQCodebook(centroids=calib[f"{name}_centroids"])
            codes = VQCodes(codes=buf.view(f"{name}_codes")[:, :, start:, :], bits=code_bits(cb.codebook_size),
                            subspaces=cb.subspaces)
            out.append(vq_decode(codes, cb, decode=ops.vq_decode))
        return out[0], out[1]
