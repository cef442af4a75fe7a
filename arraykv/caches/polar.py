"""PolarQuant / TurboQuant caches: ``pqo{b}``, ``pq{b}``, ``tq{b}`` (and ``polar``, any bits).

A layer's tokens are split in three: the first ``sink_tokens`` tokens and the most recent
``residual_window`` tokens in float16 (:mod:`arraykv.caches.window`), and the tokens between
them quantized (TurboQuant-MSE codes, optionally a QJL sketch of the key residual). When the
window overflows, its oldest tokens are quantized and appended to the codes. Before its first
token is quantized a layer is calibrated (:mod:`arraykv.caches.polar_calibration`). See
``docs/algorithms.md`` for the measurements behind the defaults and the "Packed state" section
for the arrays a fused kernel reads (:class:`~arraykv.caches.polar_codec.PolarLayerCodec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from .. import ops
from .._types import Array, Device, DType, Namespace
from .._validation import check_finite, dtype_name
from ..protocol import AttendConfig, Dequantized, DequantResult, Fused
from ..quant.bitpack import packed_nbytes
from ..quant.polar import half_dtype
from ..quant.polar_encoder import PolarEncoder
from ..storage import TokenBuffers
from .base import LayeredCache
from .layout import Layout, Spec, join
from .polar_calibration import PolarCalibration, calibrate, calibration_layout
from .polar_codec import PolarFixed, PolarLayerCodec, layer_codec
from .polar_decode import decode_layer, qjl_logit_bias
from .polar_options import (
    DEFAULT_OUTLIER_THRESHOLD,
    DEFAULT_RESIDUAL_WINDOW,
    DEFAULT_SINK_TOKENS,
    PolarOptions,
    check_polar_options,
    default_residual_window,
)
from .restore_checks import check_polar_room, check_qjl_lengths
from .rollback import DEFAULT_ROLLBACK_TOKENS
from .window import (
    ExactTokens,
    WindowLayer,
    WindowRollback,
    commit_store,
    restore_rollback,
    restore_tokens,
    rollback_arrays,
    rollback_layout,
    sliding_rows,
    token_counts,
)

__all__ = [
    "PolarCache",
    "PolarLayerCodec",
    "PolarLayer",
    "DEFAULT_RESIDUAL_WINDOW",
    "default_residual_window",
    "Pqo2Cache",
    "Pqo3Cache",
    "Pqo4Cache",
    "Pq2Cache",
    "Pq3Cache",
    "Pq4Cache",
    "Tq2Cache",
    "Tq3Cache",
    "Tq4Cache",
]

#: Per-token arrays of the encoded tokens (their names in saved files).
_PER_TOKEN = ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers", "k_qjl", "k_qjl_norms")


@dataclass
class PolarLayer(WindowLayer):
    """One layer of a :class:`PolarCache` (:class:`~arraykv.caches.window.WindowLayer`).

    ``codes`` holds the ``_PER_TOKEN`` arrays; ``calib`` is the layer's
    :class:`PolarCalibration`, set when its first token is encoded. ``window_rows`` and
    ``rollback_rows`` also serve the one-call decode store (:meth:`PolarCache._slide_one`).
    """


class PolarCache(WindowRollback, LayeredCache[PolarLayer]):
    """Rotated Lloyd-Max (TurboQuant-MSE) key/value cache with a float16 recent-token window.

    Use through the factory: ``make_cache("pqo4", ...)`` (4 bits everywhere), ``"pq4"``
    (3 bits everywhere), ``"tq4"`` (keys: 3 bits + 1-bit QJL, values: 3 bits).

    Parameters
    ----------
    num_layers, num_kv_heads : int
    head_dim : int
        >= 4. Powers of two use the randomized Walsh–Hadamard rotation; other sizes up to
        1024 a dense seeded orthogonal matrix.
    key_bits, value_bits : int
        Bits per coordinate of the MSE codes, 1 to 8 (for ``tq``, the MSE part of the keys).
    qjl : bool, default False
        Add a 1-bit QJL sketch of the key residual (TurboQuant-prod), returned as
        ``logit_bias``. Set by the ``tq`` names.
    seed : int, default 0
        Seed of the rotation (and of the QJL sketch); same seed, same cache.
    residual_window : int or None, default None
        Recent tokens kept in float16 (float32 where the namespace has no float16). None:
        :func:`default_residual_window` of ``key_bits`` (24 below 4 bits, 20 from 4 bits up).
    center : {"auto", True, False}, default "auto"
        Subtract a per-head per-channel mean of the calibration tokens from keys and values
        (``"auto"``: only where the mean holds more than 2 % of the energy).
    outliers : {"auto"} or int, default "auto"
        Key channels per head kept exactly in float16. ``"auto"``: the channels whose RMS over
        the calibration tokens exceeds ``outlier_threshold`` × the median channel RMS, at most
        ``max_outliers`` (so Gaussian-like keys get none); an int: exactly that many, largest
        RMS first; 0 turns it off.
    outlier_threshold : float, default 4.0
    max_outliers : int or None
        Cap for ``"auto"``; default ``head_dim // 16``.
    sink_tokens : int, default 4
        The first tokens of the sequence are kept in float16: models put large attention
        weights on them ("attention sinks"), so their quantization error costs most.
    key_length, value_length : {"unbiased", "fit"}, default "unbiased"
        Length stored with each key / value code (:mod:`arraykv.quant.polar`): ``"fit"`` is
        the least-squares length (smallest error per vector, but every reconstruction is
        shorter than the original by ``cos²θ``, about 12 % at 2 bits, which flattens attention
        over long contexts); ``"unbiased"`` keeps ``⟨x̂, x⟩ = ‖x‖²``.
    rope : "auto", None or dict, default "auto"
        How the key mean follows rotary position embeddings
        (:mod:`arraykv.quant.rotary_mean`): ``"auto"`` finds the convention from the
        calibration keys (the mean of the projected keys, turned to each position, is
        subtracted, which leaves 3–6× less to quantize on RoPE models) and falls back to a
        plain per-channel mean when the keys show none; ``{"theta": base, "layout": "half"
        | "interleaved"}`` gives it; None uses the plain mean. The token at index ``i`` of a
        layer is taken to be at position ``i`` (a constant offset does not matter).
    key_scale : bool, default True
        Weight key channels before the rotation: keys are quantized as ``s ⊙ (k − mean)`` and
        decoded as ``k̂' / s + mean`` with ``s_c = sqrt(rms_q[c] / rms_k[c])`` from the queries
        and centered keys of the calibration call (the prefill), normalized per head. For an
        isotropic quantizer this minimizes the expected ``q · k`` error (see Notes); heads whose
        calibration queries are all zero get ``s = 1``.
    rollback_tokens : int, default 16
        Tokens every layer can be truncated by (:meth:`truncate`) once calibrated: float16
        copies of the last ``rollback_tokens`` encoded tokens are kept (counted in
        ``memory_usage``; ``4 · rollback_tokens · head_dim`` bytes per layer, batch and head).
        0 keeps none (a truncation can then reach only into the window).
    decode_path : {"auto", "fused", "dequantized"}, default "auto"
        How ``decode`` attends (see Notes).
    softmax_scale : float or None
        Scale applied to the QJL ``logit_bias`` returned by ``prefill`` (``decode`` uses its
        ``AttendConfig``); default ``1 / sqrt(head_dim)``.
    check_finite, max_tokens
        See :class:`~arraykv.caches.base.LayeredCache`.

    Notes
    -----
    ``prefill`` returns the exact K/V of a layer's first prefill (nothing was lost yet) and the
    dequantized K/V of every stored token afterwards. ``decode`` attends straight from the
    packed codes and returns :class:`~arraykv.Fused` when a fused kernel exists for the
    namespace (Numba on NumPy, CUDA on CuPy), else :class:`~arraykv.Dequantized`;
    ``decode_path="fused"`` or ``"dequantized"`` forces either (``"fused"`` without a kernel
    runs the array-API version, :mod:`arraykv.attention.polar_fused`). ``memory_usage()``
    counts codes, norms, window, calibration and outlier side data, and the
    rotation/codebook/sketch arrays held.

    Key channel weights: the rotated quantizer leaves an error ``e'`` on ``k' = s ⊙ k`` that is
    isotropic with ``E‖e'‖² = ε ‖k'‖²``; decoding ``k̂ = k̂' / s`` turns it into a logit error
    with ``E(q·e)² ∝ ε (Σ_c s_c² k_c²)(Σ_c q_c² / s_c²)``. By Cauchy–Schwarz this is smallest,
    ``ε (Σ_c |k_c| |q_c|)²``, at ``s_c² ∝ |q_c| / |k_c|`` (channel RMS values in practice),
    against ``ε Σ_c k_c² Σ_c q_c²`` unweighted. Weighting by the query RMS alone (``s = rms_q``)
    can be far worse than nothing when keys and queries load the same channels, as the keys
    and queries of RoPE models do.
    """

    method = "polar"
    _calibration_given = False  # only a spilling window calibrates a layer
    #: Options a subclass fixes (its method name says them); not constructor arguments there.
    _fixed_options: dict[str, Any] = {}

    if TYPE_CHECKING:  # read-only views of ``options``, set below the class
        key_bits: int
        value_bits: int
        qjl: bool
        seed: int
        residual_window: int
        sink_tokens: int
        key_length: str
        value_length: str
        softmax_scale: float | None

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        key_bits: int,
        value_bits: int,
        qjl: bool = False,
        seed: int = 0,
        residual_window: int | None = None,
        center: bool | str = "auto",
        outliers: int | Literal["auto"] = "auto",
        outlier_threshold: float = DEFAULT_OUTLIER_THRESHOLD,
        max_outliers: int | None = None,
        key_scale: bool = True,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        key_length: str = "unbiased",
        value_length: str = "unbiased",
        rope: dict[str, Any] | str | None = "auto",
        softmax_scale: float | None = None,
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
        self.options: PolarOptions = check_polar_options(
            self.head_dim,
            key_bits=key_bits,
            value_bits=value_bits,
            qjl=qjl,
            seed=seed,
            residual_window=residual_window,
            center=center,
            outliers=outliers,
            outlier_threshold=outlier_threshold,
            max_outliers=max_outliers,
            key_scale=key_scale,
            sink_tokens=sink_tokens,
            key_length=key_length,
            value_length=value_length,
            rope=rope,
            softmax_scale=softmax_scale,
            decode_path=decode_path,
            rollback_tokens=rollback_tokens,
        )
        self._fixed: dict[tuple[int, str], PolarFixed] = {}

    # -- fixed state (rotation, codebooks, sketch), one set per namespace and device ------
    def _codec(self, xp: Namespace, dev: Device) -> PolarFixed:
        key = (id(xp), str(dev))
        c = self._fixed.get(key)
        if c is None:
            c = PolarFixed.build(
                xp,
                dev,
                head_dim=self.head_dim,
                key_bits=self.key_bits,
                value_bits=self.value_bits,
                seed=self.seed,
                qjl=self.qjl,
            )
            self._fixed[key] = c
        return c

    def _fixed_nbytes(self) -> int:
        return sum(c.nbytes() for c in list(self._fixed.values()))

    def _on_reset(self) -> None:
        self._fixed = {}

    def _fork_fixed(self, source: PolarCache) -> None:
        self._fixed = dict(source._fixed)

    def _extra_config(self) -> dict[str, Any]:
        cfg = self.options.config()
        for name in self._fixed_options:  # said by the method name
            del cfg[name]
        return cfg

    # -- layer state -------------------------------------------------------------------
    def _new_layer(self, xp: Namespace, dev: Device, batch: int, dtype: DType) -> PolarLayer:
        self._codec(xp, dev)  # the rotation/codebooks are held from a layer's first token on
        empty = ExactTokens.empty(xp, dev, batch, self.num_kv_heads, self.head_dim)
        return PolarLayer(
            xp=xp,
            device=dev,
            batch=batch,
            dtype=dtype,
            codes=TokenBuffers(max_tokens=self.max_tokens),
            exact=empty,
            rollback=empty,
        )

    def _encode(
        self, xp: Namespace, fixed: PolarFixed, calib: PolarCalibration, k: Array, v: Array, start: int
    ) -> dict[str, Array]:
        """Quantize float32 tokens (b, h, t, d) at positions ``start ..`` -> the per-token arrays to append
        (centring, weights, outliers, both encodes and a ``tq`` key's QJL sketch in one op)."""
        return ops.polar_encode_tokens(k, v, self._encoder(fixed, calib), start)

    def _encoder(self, fixed: PolarFixed, calib: PolarCalibration) -> PolarEncoder:
        """What the encode ops take besides the tokens and their position: the calibration, the
        codebooks and rotation, the length rules and the QJL sketch (or None)."""
        opts = self.options
        key = (fixed, opts.key_length, opts.value_length, opts.qjl)
        held = calib.__dict__.get("_encoder")  # made once per layer calibration and fixed set, not per call
        if held is not None and held[0] is fixed and held[1:-1] == key[1:]:
            enc: PolarEncoder = held[-1]
            return enc
        enc = fixed.encoder(calib, key_length=opts.key_length, value_length=opts.value_length, qjl=opts.qjl)
        object.__setattr__(calib, "_encoder", (*key, enc))
        return enc

    def _store(self, st: PolarLayer, k: Array, v: Array, q: Array) -> None:
        """Append new tokens: sinks, then the window, its overflow quantized (computed, then committed)."""
        xp = st.xp
        if int(k.shape[2]) == 1 and self._slides(st, k):
            if self._slide_one(st, k, v):
                return
            if self.check_finite:  # not checked on admission (_store_refuses_nonfinite): refuse NaN or inf here
                check_finite(xp, k=k, v=v)
        step = st.exact.step(xp, k, v, q, sink_tokens=self.sink_tokens)
        first = step.n_sink + st.codes.length  # position of the window's oldest token
        spill = step.spill(self.residual_window)
        calib = st.calib
        arrays = None
        if spill:
            if calib is None:  # calibrate on every token held so far, then quantize the oldest
                allk, allv = step.first(step.n_recent + step.n_new)
                calib = calibrate(self.options, xp, allk, allv, step.q, first)
                ek, ev = allk[:, :, :spill, :], allv[:, :, :spill, :]
            else:  # only the tokens that leave the window are converted
                ek, ev = step.first(spill)
            arrays = self._encode(xp, self._codec(xp, st.device), calib, ek, ev, first)
        commit_store(
            xp,
            self.method,
            st,
            step,
            spill,
            arrays,
            calib,
            {} if calib is st.calib else calib.arrays(),
            self.rollback_tokens,
        )

    def _slides(self, st: PolarLayer, k: Array) -> bool:
        """Whether the store of the one token ``k`` takes :meth:`_slide_one`'s path: a calibrated
        layer whose sinks and window are full and whose token buffers exist, not float64 keys
        (float64 -> float32 -> float16 could round twice: the general path)."""
        exact = st.exact
        ns = exact.n_sink
        opts = self.options
        window = opts.residual_window
        return bool(
            st.calib is not None
            and window
            and ns >= opts.sink_tokens
            and int(exact.k.shape[2]) - ns == window
            and st.codes.capacity
            and k.dtype != st.xp.float64
        )

    def _store_refuses_nonfinite(self, st: PolarLayer, k: Array) -> bool:
        # the op of _slide_one refuses a token whose float16 rows are not finite (so NaN and
        # inf), and _store then raises check_finite's error before anything changed
        return self._slides(st, k)

    def _slide_one(self, st: PolarLayer, k: Array, v: Array) -> bool:
        """Store one token in a layer of :meth:`_slides`, in place; False (nothing done) when a
        float16 result is not finite: the new token holds NaN or inf (the caller then refuses
        it, :meth:`_store_refuses_nonfinite`), or a value overflows float16 (the general path
        then refuses the call, naming what overflows).

        The same store as the general path (the oldest window token encoded, its float16 row
        kept as a rollback copy, the new token's row appended to the window), done by one op
        (:func:`arraykv.ops.polar_store_token`) into rows already allocated: the next index of
        the token buffers and the spare row after the window, a view of a larger buffer that
        slides in place (:class:`~arraykv.caches.sliding.SlidingRows`). Only after it succeeds
        do the window, the rollback copies and the token count move.
        """
        exact = st.exact
        ns = exact.n_sink
        calib = st.calib
        codes = st.codes
        xp = st.xp
        # block_room(st, "exact", 1), spelt out: the room may move the block (same rows, renewed views)
        window = sliding_rows(st, "window_rows", exact)
        arriving = window.room(1)
        if window.k is not exact.k:
            st.exact = ExactTokens(k=window.k, v=window.v, n_sink=ns)
        at = codes.length
        rows = codes.room(1)
        if k.dtype != xp.float32:  # float16, bfloat16: exact in float32
            k, v = xp.astype(k, xp.float32), xp.astype(v, xp.float32)
        leaving = window.offset + ns
        if not ops.polar_store_token(
            k,
            v,
            window.key_rows,
            window.value_rows,
            leaving,
            arriving,
            self._encoder(self._codec(xp, st.device), calib),
            ns + at,
            rows,
            at,
        ):
            return False
        keep = self.options.rollback_tokens
        if keep:  # the leaving row becomes the newest rollback copy (before the window slides over it)
            held = st.rollback
            margin = sliding_rows(st, "rollback_rows", held)
            mrow = margin.room(1)
            if margin.k is not held.k:  # the same rows, moved: renewed views
                st.rollback = ExactTokens(k=margin.k, v=margin.v, n_sink=held.n_sink)
            margin.key_rows[:, :, mrow : mrow + 1, ...] = window.key_rows[:, :, leaving : leaving + 1, :]
            margin.value_rows[:, :, mrow : mrow + 1, ...] = window.value_rows[:, :, leaving : leaving + 1, :]
            mk, mv = margin.advance(held.n_sink, max(0, int(held.k.shape[2]) + 1 - keep), 1)
            st.rollback = ExactTokens(k=mk, v=mv, n_sink=held.n_sink)
        codes.advance(1)
        wk, wv = window.advance(ns, 1, 1)
        st.exact = ExactTokens(k=wk, v=wv, n_sink=ns)
        return True

    def _decoded(self, st: PolarLayer, start: int = 0) -> DequantResult:
        """K/V of the stored tokens ``start ..`` in the layer's dtype.

        See :func:`~arraykv.caches.polar_decode.decode_layer`.
        """
        xp = st.xp
        k, v = decode_layer(st, self._codec(xp, st.device), self.options, start)  # fresh arrays: cast in place
        return DequantResult(k=xp.astype(k, st.dtype, copy=False), v=xp.astype(v, st.dtype, copy=False))

    def _result(self, st: PolarLayer, q: Array, scale: float) -> DequantResult:
        xp = st.xp
        k, v = decode_layer(st, self._codec(xp, st.device), self.options)
        bias = qjl_logit_bias(st, self._codec(st.xp, st.device), q, scale) if self.qjl and st.codes.length else None
        return DequantResult(
            k=xp.astype(k, st.dtype, copy=False),
            v=xp.astype(v, st.dtype, copy=False),
            logit_bias=None if bias is None else xp.astype(bias, q.dtype, copy=False),
        )

    # -- hooks -----------------------------------------------------------------------
    def _prefill(self, st: PolarLayer, k: Array, v: Array, q: Array) -> DequantResult:
        first = st.length == 0
        self._store_tokens(st, k, v, q)
        if first:
            return DequantResult(k=k, v=v)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        return self._result(st, q, scale)

    def _decode(self, st: PolarLayer, k: Array, v: Array, q: Array, config: AttendConfig) -> Fused | Dequantized:
        self._store_tokens(st, k, v, q)
        if self._fused(st.xp):
            return Fused(ops.polar_decode_attention(self._codec_state(st), q, config.softmax_scale))
        return Dequantized(self._result(st, q, config.softmax_scale))

    def _fused_auto(self, xp: Namespace) -> bool:
        return ops.has_kernel("polar_decode_attention", xp)

    def _stable_length(self, st: PolarLayer) -> int:
        return st.exact.n_sink + st.codes.length  # sinks and codes never change; the window does

    def _uncalibrated_at(self, st: PolarLayer, length: int) -> bool:
        # a layer calibrates when its window first spills
        return length - min(self.sink_tokens, length) <= self.residual_window

    # -- persistence view: the saved names are k_window (sinks, then recent), codes, calibration
    def _layer_arrays(self, st: PolarLayer) -> dict[str, Array]:
        out = dict(st.codes.arrays())
        out["k_window"] = st.exact.k
        out["v_window"] = st.exact.v
        if st.calib is not None:
            out.update(st.calib.arrays())
        out.update(rollback_arrays(st))
        return out

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout:
        """The saved arrays of a layer: the calibration (:func:`calibration_layout`), the encoded
        tokens (codes of the packed widths of ``key_bits``/``value_bits``, float16 norms, the
        outlier channels' exact values, a ``tq`` key's sketch), the float16 sinks and window
        (``k_window``, ``v_window``) and the rollback state, with the token counts of
        :func:`~arraykv.caches.window.token_counts`."""
        b, h, d = batch, self.num_kv_heads, self.head_dim
        half = half_dtype(xp)
        tok = (b, h, "codes")
        per_token = {
            "k_codes": Spec(xp.uint8, tok + (packed_nbytes(d, self.key_bits),), required=False),
            "k_norms": Spec(half, tok, required=False),
            "v_codes": Spec(xp.uint8, tok + (packed_nbytes(d, self.value_bits),), required=False),
            "v_norms": Spec(half, tok, required=False),
            "k_outliers": Spec(half, tok + ("n_out",), required=False),
        }
        group: tuple[str, ...] = ("k_codes", "k_norms", "v_codes", "v_norms")
        if self.qjl:
            per_token.update(
                k_qjl=Spec(xp.uint8, tok + (packed_nbytes(d, 1),), required=False),
                k_qjl_norms=Spec(half, tok, required=False),
            )
            group += ("k_qjl", "k_qjl_norms")
        exact = {"k_window": Spec(half, (b, h, "exact", d)), "v_window": Spec(half, (b, h, "exact", d))}
        sinks = min(self.sink_tokens, length)

        def counts(sizes: dict[str, int], held: frozenset[str]) -> str | None:
            calibrated = "k_mean" in held
            codes = sizes.get("codes", 0)
            msg = token_counts(
                self,
                length,
                sinks,
                sizes["exact"] - sinks,
                codes,
                sizes.get("copies", 0),
                calibrated,
                spill_calibrates=True,
            )
            if msg is None and ("k_outliers" in held) != ("k_codes" in held and sizes.get("n_out", 0) > 0):
                msg = (
                    "stored 'k_outliers' must come with the encoded tokens exactly when the calibration keeps "
                    "outlier channels"
                )
            return msg

        parts = Layout(arrays={**per_token, **exact}, groups=(group,))
        return join(
            calibration_layout(xp, b, h, d),
            parts,
            rollback_layout(xp, b, h, d),
            sizes={"length": length},
            rules=(counts,),
        )

    def _restore_layer(
        self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
    ) -> PolarLayer:
        st = self._new_layer(xp, dev, batch, dtype)
        exact = ExactTokens(
            k=xp.asarray(arrays["k_window"], copy=True),
            v=xp.asarray(arrays["v_window"], copy=True),
            n_sink=min(self.sink_tokens, length),
        )
        restore_tokens(st, arrays, _PER_TOKEN, exact, length)
        st.calib = PolarCalibration.from_arrays(xp, arrays)
        restore_rollback(st, arrays)
        self._check_room(st)
        return st

    def _check_room(self, st: PolarLayer) -> None:
        """Refuse a restored layer that leaves no float16 room for its window or the next token
        (:mod:`arraykv.caches.restore_checks`), or holds ``tq`` residual lengths its codes cannot have."""
        xp = st.xp
        fixed = self._codec(xp, st.device)
        kw, vw = st.exact.recent()
        check_polar_room(
            xp,
            head_dim=self.head_dim,
            calib=st.calib,
            k_blocks={"k_window": kw, "k_rollback": st.rollback.k},
            v_blocks={"v_window": vw, "v_rollback": st.rollback.v},
            k_codebook=fixed.k_codebook,
            v_codebook=fixed.v_codebook,
            qjl=self.qjl,
            half_output=dtype_name(st.dtype) == "float16",
        )
        if self.qjl and st.codes.length:
            check_qjl_lengths(
                xp,
                k_norms=st.codes.view("k_norms"),
                k_qjl_norms=st.codes.view("k_qjl_norms"),
                k_codebook=fixed.k_codebook,
                head_dim=self.head_dim,
                unbiased=self.key_length == "unbiased",
            )

    def _side_nbytes(self, st: PolarLayer) -> int:
        return st.exact.nbytes() + self._rollback_nbytes(st) + (0 if st.calib is None else st.calib.nbytes())

    # -- inspection for kernels ------------------------------------------------------
    def layer_codec_state(self, layer: int) -> PolarLayerCodec | None:
        """The arrays of ``layer`` as a :class:`PolarLayerCodec` (views, not copies), or None if empty.

        Valid until the next call that changes the layer; read, never write.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        PolarLayerCodec or None
            Everything a kernel needs to read the layer (views); None for an empty layer.
        """
        return self._with_layer(layer, self._codec_state)

    def _codec_state(self, st: PolarLayer) -> PolarLayerCodec:
        """:meth:`layer_codec_state` of a layer whose lock the caller holds."""
        xp = st.xp
        fixed = self._codec(xp, st.device)
        buf = st.codes
        calib = st.calib
        views = buf.arrays()  # the in-use views of every token array, by name
        if "k_codes" not in views:  # no token encoded yet: empty arrays of the same axes
            views = self._empty_tokens(st)
        exact = st.exact
        qjl = self.options.qjl
        has_out = calib is not None and calib.n_outliers > 0
        return layer_codec(
            n_sink=exact.n_sink,
            n_quantized=buf.length,
            n_window=exact.count,
            rotation=fixed.rotation,
            k_codebook=fixed.k_codebook,
            v_codebook=fixed.v_codebook,
            k_codes=views["k_codes"],
            k_norms=views["k_norms"],
            v_codes=views["v_codes"],
            v_norms=views["v_norms"],
            k_mean=None if calib is None else calib.k_mean,
            v_mean=None if calib is None else calib.v_mean,
            k_scale=None if calib is None else calib.k_scale,
            k_mean_freq=None if calib is None else calib.k_mean_freq,
            k_mean_pairs=None if calib is None else calib.k_mean_pairs,
            k_outlier_idx=calib.k_outlier_idx if has_out else None,
            k_outliers=views.get("k_outliers") if has_out else None,
            k_window=exact.k,
            v_window=exact.v,
            qjl=fixed.qjl,
            k_qjl=views.get("k_qjl") if qjl else None,
            k_qjl_norms=views.get("k_qjl_norms") if qjl else None,
            k_mean_plan=None if calib is None else calib.rotary_plan(),
        )

    def _empty_tokens(self, st: PolarLayer) -> dict[str, Array]:
        """Token arrays of no token, (batch, heads, 0, ...), for a layer that has encoded none."""
        xp, d = st.xp, self.head_dim
        half = half_dtype(xp)
        tails = {
            "k_codes": ((packed_nbytes(d, self.key_bits),), xp.uint8),
            "k_norms": ((), half),
            "v_codes": ((packed_nbytes(d, self.value_bits),), xp.uint8),
            "v_norms": ((), half),
        }
        if self.qjl:
            tails.update(k_qjl=((packed_nbytes(d, 1),), xp.uint8), k_qjl_norms=((), half))
        head = (st.batch, self.num_kv_heads, 0)
        return {name: xp.zeros(head + tail, dtype=dt, device=st.device) for name, (tail, dt) in tails.items()}


def _option(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}`` (read-only).")


for _f in fields(PolarOptions):  # cache.key_bits, cache.residual_window, ...: read from ``options``, the one copy
    setattr(PolarCache, _f.name, _option(_f.name))
del _f


def _preset(name: str, key_bits: int, value_bits: int, qjl: bool) -> type:
    """The class of method ``name``: a :class:`PolarCache` with these bits and ``qjl`` fixed."""

    def __init__(
        self: PolarCache,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        key_bits: int = key_bits,
        value_bits: int = value_bits,
        **options: Any,
    ) -> None:
        PolarCache.__init__(
            self,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            key_bits=key_bits,
            value_bits=value_bits,
            qjl=qjl,
            **options,
        )

    what = f"keys {key_bits} bits{' + 1-bit QJL' if qjl else ''}, values {value_bits} bits"
    cls = type(
        f"{name.capitalize()}Cache",
        (PolarCache,),
        {
            "__init__": __init__,
            "method": name,
            "_fixed_options": {"qjl": qjl},
            "__module__": __name__,
            "__doc__": f"``{name}``: {what} (``key_bits``/``value_bits`` may be overridden); options of "
            ":class:`PolarCache` except ``qjl``.",
        },
    )
    return cls


Pqo2Cache = _preset("pqo2", 2, 2, False)
Pqo3Cache = _preset("pqo3", 3, 3, False)
Pqo4Cache = _preset("pqo4", 4, 4, False)
Pq2Cache = _preset("pq2", 1, 1, False)
Pq3Cache = _preset("pq3", 2, 2, False)
Pq4Cache = _preset("pq4", 3, 3, False)
Tq2Cache = _preset("tq2", 1, 1, True)
Tq3Cache = _preset("tq3", 2, 2, True)
Tq4Cache = _preset("tq4", 3, 3, True)
