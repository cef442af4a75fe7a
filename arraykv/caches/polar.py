"""PolarQuant / TurboQuant caches: ``pqo{b}``, ``pq{b}``, ``tq{b}``.

A layer's tokens are split in two: the oldest ones quantized (TurboQuant-MSE codes, optionally
a QJL sketch of the key residual), then the most recent ``residual_window`` tokens kept in
float16. When the window overflows, its oldest tokens are quantized and appended to the codes.

Before quantization a layer is *calibrated* once, on every token it holds at the moment its
first token must be quantized (normally the first prefill): a per-head per-channel mean is
subtracted from keys and values when it carries a noticeable share of their energy, key
channels are weighted by ``sqrt(rms_q / rms_k)`` (which minimizes the expected error of the
logits ``q · k``), and the key channels whose magnitude stands out (outlier channels) are kept
exactly, in float16, instead of going through the rotation. The first ``sink_tokens`` tokens
are kept in float16 as well. See ``docs/algorithms.md`` for the measurements behind
the defaults and the "Packed state" section for the arrays a fused kernel reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._validation import check_int
from .. import ops
from ..protocol import AttendConfig, Dequantized, DequantResult, Fused
from ..quant.bitpack import packed_nbytes
from ..quant.codebooks import Codebook, make_codebook
from ..quant.polar import LENGTHS, PolarCode, half_dtype, polar_decode, polar_encode
from ..quant.qjl import QJL_SCALE, QJLSketch, make_sketch, qjl_encode
from ..quant.rotary_mean import check_rope, fit_rotary_mean, rotary_mean_at
from ..quant.rotation import Rotation, is_power_of_two, make_rotation
from ..storage import TokenBuffers
from .base import LayeredCache, LayerState, check_decode_path
from .registry import register_method

__all__ = ["PolarCache", "PolarLayerCodec", "DEFAULT_RESIDUAL_WINDOW", "default_residual_window"]

#: Recent tokens kept in float16 by default, by key bits (chosen by measurement, see
#: docs/algorithms.md §8): 4-bit codes are accurate enough that four more exact tokens buy
#: less than the 0.09 bits/value they cost at 512 tokens; at 3 bits and below they pay.
DEFAULT_RESIDUAL_WINDOW = {1: 24, 2: 24, 3: 24, 4: 20}


def default_residual_window(key_bits: int) -> int:
    """The default ``residual_window`` for keys of ``key_bits`` MSE bits (20 from 4 bits up, else 24)."""
    return DEFAULT_RESIDUAL_WINDOW.get(int(key_bits), 20)

#: First tokens of a sequence kept in float16 (attention sinks; chosen by measurement).
DEFAULT_SINK_TOKENS = 4
#: A channel is an outlier when its RMS exceeds this multiple of the head's median channel RMS.
DEFAULT_OUTLIER_THRESHOLD = 4.0
#: Centering is used when the mean carries more than this share of the vectors' energy.
CENTER_MIN_SHARE = 0.02
#: Fewer calibration tokens than this: no centering and no "auto" outlier channels.
MIN_CALIBRATION_TOKENS = 8
#: Largest non-power-of-two head_dim (a dense head_dim² rotation is held).
MAX_DENSE_HEAD_DIM = 1024


@dataclass(frozen=True)
class PolarLayerCodec:
    """Everything a kernel needs to read one layer of a :class:`PolarCache` (no copies).

    Token ``t < n_quantized`` of head ``(b, h)`` is decoded as::

        k = k_norms[b,h,t] · Mᵀ k_codebook.centroids[unpack(k_codes[b,h,t])]    (rotation part)
        k[c] = k_outliers[b,h,t,j]  for c = k_outlier_idx[b,h,j]             (exact channels)
        k = k / k_scale[b,h] + m_t[b,h]                                       (weights, centering)

    where ``m_t`` is the key mean at the token's position ``p = n_sink + t``: ``k_mean[b,h]``
    itself, or, with ``k_mean_freq`` (keys with rotary embeddings), ``k_mean`` turned by the
    angle ``k_mean_freq[b,h,j] · p`` in each channel pair ``k_mean_pairs[j]``
    (:func:`arraykv.quant.rotary_mean.rotary_mean_at`).

    and likewise for values (no outlier channels). The layer's token order is
    ``k_window[:, :, :n_sink]`` (the first tokens), the quantized tokens (``t`` above), then
    ``k_window[:, :, n_sink:]`` (the recent tokens). A decode kernel may treat ``k_window`` as
    one block of exact tokens: one query's attention does not depend on the order of keys. For TurboQuant-prod keys the logit of query ``q`` gains
    ``softmax_scale · √(π/2)/m · k_qjl_norms[b,h,t] · ⟨S q, ±1(k_qjl[b,h,t])⟩``.

    Attributes
    ----------
    n_sink : int
        Sink tokens: the first ``n_sink`` rows of ``k_window``/``v_window`` are the first
        tokens of the sequence (kept in float16, they come *before* the quantized tokens).
    n_quantized, n_window : int
        Quantized tokens, and float16 tokens (``n_window`` counts the sinks too).
    rotation : Rotation
        ``M``; for ``kind == "hadamard"``, ``M x = H (signs ⊙ x) / √d``.
    k_codebook, v_codebook : Codebook
        Centroids of rotated unit-vector coordinates (``bits`` = key/value MSE bits).
    k_codes, v_codes : uint8 (batch, kv_heads, n_quantized, ceil(d·bits/8))
    k_norms, v_norms : float16 (batch, kv_heads, n_quantized)
    k_mean, v_mean : float16 (batch, kv_heads, d) or None before calibration
    k_scale : float16 (batch, kv_heads, d) or None before calibration
        Query-derived channel weights ``s``: keys are encoded as ``s ⊙ (k − m_t)``, so the
        rotation part and ``k_outliers`` decode to ``s ⊙ (k − m_t)``; divide by ``s``
        (or, in a kernel, multiply the query by ``1/s``) before adding ``m_t``.
    k_mean_freq : float32 (batch, kv_heads, d // 2) or None
        Angular frequency (radians per position) of each channel pair of the key mean; 0 for a
        pair whose mean does not turn. None: the key mean is ``k_mean`` at every position.
    k_mean_pairs : int32 (d // 2, 2) or None
        Channels ``(a, b)`` of each pair: ``m[a] = μ_a cos φ − μ_b sin φ``,
        ``m[b] = μ_b cos φ + μ_a sin φ`` with ``φ = k_mean_freq · p``.
    k_outlier_idx : int32 (batch, kv_heads, n_out) or None
    k_outliers : float16 (batch, kv_heads, n_quantized, n_out) or None
        Exact (centered) key values of the outlier channels; the rotated part was encoded with
        those channels set to zero.
    k_window, v_window : float16 (batch, kv_heads, n_window, d)
        Sink tokens, then the recent tokens, as given (rounded to float16).
    qjl : QJLSketch or None
        ``S`` (m, d) for ``tq`` caches.
    k_qjl : uint8 (batch, kv_heads, n_quantized, ceil(m/8)) or None
        ``S r >= 0`` bits of the key residual ``r`` (outlier channels excluded).
    k_qjl_norms : float16 (batch, kv_heads, n_quantized) or None
        ``‖r‖``.
    """

    n_sink: int
    n_quantized: int
    n_window: int
    rotation: Rotation
    k_codebook: Codebook
    v_codebook: Codebook
    k_codes: Any
    k_norms: Any
    v_codes: Any
    v_norms: Any
    k_mean: Any
    v_mean: Any
    k_scale: Any
    k_mean_freq: Any
    k_mean_pairs: Any
    k_outlier_idx: Any
    k_outliers: Any
    k_window: Any
    v_window: Any
    qjl: Any
    k_qjl: Any
    k_qjl_norms: Any


class PolarCache(LayeredCache):
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

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, key_bits: int, value_bits: int,
                 qjl: bool = False, seed: int = 0, residual_window: int | None = None,
                 center: Any = "auto", outliers: Any = "auto", outlier_threshold: float = DEFAULT_OUTLIER_THRESHOLD,
                 max_outliers: int | None = None, key_scale: bool = True, sink_tokens: int = DEFAULT_SINK_TOKENS,
                 key_length: str = "unbiased", value_length: str = "unbiased", rope: Any = "auto",
                 softmax_scale: float | None = None,
                 decode_path: str = "auto", check_finite: bool = True, max_tokens: int | None = None):
        super().__init__(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         check_finite=check_finite, max_tokens=max_tokens)
        d = self.head_dim
        if d < 4:
            raise ValueError(f"head_dim must be >= 4 for the rotated quantizers, received {d}")
        if not is_power_of_two(d) and d > MAX_DENSE_HEAD_DIM:
            raise ValueError(
                f"head_dim must be a power of two or at most {MAX_DENSE_HEAD_DIM} (a dense rotation is held), "
                f"received {d}"
            )
        self.key_bits = check_int("key_bits", key_bits, low=1, high=8)
        self.value_bits = check_int("value_bits", value_bits, low=1, high=8)
        if not isinstance(qjl, bool):
            raise TypeError(f"qjl must be a bool, received {type(qjl).__name__}")
        self.qjl = qjl
        self.seed = check_int("seed", seed, low=0)
        if residual_window is None:
            residual_window = default_residual_window(self.key_bits)
        self.residual_window = check_int("residual_window", residual_window, low=0)
        if center not in ("auto", True, False) or isinstance(center, int) and not isinstance(center, bool):
            raise ValueError(f"center must be 'auto', True or False, received {center!r}")
        self.center = center
        if outliers != "auto":
            if isinstance(outliers, str):
                raise ValueError(f"outliers must be 'auto' or an integer, received {outliers!r}")
            outliers = check_int("outliers", outliers, low=0, high=d - 1)
        self.outliers = outliers
        if isinstance(outlier_threshold, bool) or not isinstance(outlier_threshold, (int, float)) \
                or not 1.0 <= float(outlier_threshold) < float("inf"):
            raise ValueError(f"outlier_threshold must be a finite number >= 1, received {outlier_threshold!r}")
        self.outlier_threshold = float(outlier_threshold)
        self.max_outliers = d // 16 if max_outliers is None else check_int("max_outliers", max_outliers, low=0,
                                                                          high=d - 1)
        if softmax_scale is None:
            self.softmax_scale = None
        else:
            if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                    or not 0.0 < float(softmax_scale) < float("inf"):
                raise ValueError(f"softmax_scale must be positive and finite, received {softmax_scale!r}")
            self.softmax_scale = float(softmax_scale)
        if not isinstance(key_scale, bool):
            raise TypeError(f"key_scale must be a bool, received {type(key_scale).__name__}")
        self.key_scale = key_scale
        for name, value in (("key_length", key_length), ("value_length", value_length)):
            if not isinstance(value, str) or value not in LENGTHS:
                raise ValueError(f"{name} must be one of {', '.join(LENGTHS)}, received {value!r}")
        self.key_length, self.value_length = key_length, value_length
        self.rope = check_rope(rope)
        self.sink_tokens = check_int("sink_tokens", sink_tokens, low=0)
        self.decode_path = check_decode_path(decode_path)
        self._fixed: dict = {}

    # -- fixed state (rotation, codebooks, sketch), one set per namespace and device ------
    def _codec(self, xp: Any, dev: Any) -> dict:
        key = (id(xp), str(dev))
        c = self._fixed.get(key)
        if c is None:
            d = self.head_dim
            c = {"rotation": make_rotation(d, self.seed, xp=xp, device=dev),
                 "k_codebook": make_codebook(self.key_bits, d, xp=xp, device=dev),
                 "v_codebook": make_codebook(self.value_bits, d, xp=xp, device=dev),
                 "qjl": make_sketch(d, self.seed, xp=xp, device=dev) if self.qjl else None}
            self._fixed[key] = c
        return c

    def _fixed_nbytes(self) -> int:
        total = 0
        for c in list(self._fixed.values()):
            total += c["rotation"].nbytes + c["k_codebook"].nbytes
            if self.value_bits != self.key_bits:
                total += c["v_codebook"].nbytes
            if c["qjl"] is not None:
                total += c["qjl"].nbytes
        return total

    def _on_reset(self) -> None:
        self._fixed = {}

    def _extra_config(self) -> dict:
        return {"key_bits": self.key_bits, "value_bits": self.value_bits, "seed": self.seed,
                "residual_window": self.residual_window, "center": self.center, "outliers": self.outliers,
                "outlier_threshold": self.outlier_threshold, "max_outliers": self.max_outliers,
                "key_scale": self.key_scale, "sink_tokens": self.sink_tokens, "key_length": self.key_length,
                "value_length": self.value_length,
                "rope": self.rope,
                "softmax_scale": self.softmax_scale, "decode_path": self.decode_path}

    # -- layer state -------------------------------------------------------------------
    def _new_layer(self, xp, dev, batch, dtype) -> LayerState:
        st = super()._new_layer(xp, dev, batch, dtype)
        self._codec(xp, dev)  # the rotation/codebooks are held from a layer's first token on
        st.extra["codes"] = TokenBuffers(max_tokens=self.max_tokens)
        h, d = self.num_kv_heads, self.head_dim
        wdt = half_dtype(xp)
        st.extra["k_window"] = xp.zeros((batch, h, 0, d), dtype=wdt, device=dev)
        st.extra["v_window"] = xp.zeros((batch, h, 0, d), dtype=wdt, device=dev)
        st.extra["calib"] = None  # dict of k_mean, v_mean, k_outlier_idx once calibrated
        return st

    def _calibrate(self, xp: Any, k: Any, v: Any, q: Any, start: int) -> dict:
        """Per-head statistics of float32 tokens ``k``, ``v`` (b, h, n, d) -> calibration arrays.

        ``start`` is the position of the first token. With fewer than
        ``MIN_CALIBRATION_TOKENS`` tokens the means are zero and ``"auto"`` selects no outlier
        channel (one token says nothing about channel statistics). The key mean is a rotating
        one (:mod:`arraykv.quant.rotary_mean`) where the keys carry rotary embeddings.
        """
        d = self.head_dim
        half = half_dtype(xp)
        dev = _compat.device(k)
        out = {}
        few = int(k.shape[2]) < MIN_CALIBRATION_TOKENS
        rm = fit_rotary_mean(k, start, rope=self.rope if self.center is not False and not few else None)
        for name, x in (("k", k), ("v", v)):
            if name == "k":
                mu = rm.mean
                removed = xp.sum(mu * mu, axis=-1)  # |R_t mu|^2 = |mu|^2 at every position
            else:
                mu = xp.mean(x, axis=2)
                removed = xp.sum(mu * mu, axis=-1)
            use = xp.ones(tuple(mu.shape[:2]), dtype=xp.bool, device=dev)
            if few or not self.center:
                use = xp.zeros_like(use)
            elif self.center == "auto":
                energy = xp.mean(xp.sum(x * x, axis=-1), axis=2)
                use = removed > CENTER_MIN_SHARE * energy
            out[name + "_mean"] = xp.astype(xp.where(use[..., None], mu, xp.zeros_like(mu)), half)
            if name == "k" and rm.layout is not None:
                out["k_mean_freq"] = xp.where(use[..., None], rm.freq, xp.zeros_like(rm.freq))
                out["k_mean_pairs"] = rm.pairs
        kc = k - self._key_mean(xp, out, start, int(k.shape[2]))
        out["k_scale"] = self._query_scale(xp, q, kc)
        rms = xp.sqrt(xp.mean(kc * kc, axis=2))  # (b, h, d), of the centered, unweighted keys
        if self.outliers == "auto" and few:
            n_out = 0
        elif self.outliers == "auto":
            med = xp.sort(rms, axis=-1)[..., d // 2]
            count = xp.sum(xp.astype(rms > self.outlier_threshold * med[..., None], xp.int32), axis=-1)
            n_out = min(self.max_outliers, int(xp.max(count)))
        else:
            n_out = self.outliers
        if n_out > 0:
            order = xp.argsort(rms, axis=-1, descending=True, stable=True)[..., :n_out]
            out["k_outlier_idx"] = xp.astype(xp.sort(order, axis=-1), xp.int32)
        else:
            out["k_outlier_idx"] = xp.zeros(tuple(rms.shape[:2]) + (0,), dtype=xp.int32, device=dev)
        return out

    def _query_scale(self, xp: Any, q: Any, kc: Any):
        """Per-head key channel weights ``s = sqrt(rms_q / rms_k)`` (b, h, d), half precision.

        ``rms_q`` is the RMS of the group's calibration queries in each channel, ``rms_k`` that
        of the centered keys ``kc``. Weights are normalized to mean square 1 per head and
        clipped to [1/16, 16]. Ones when ``key_scale`` is off, with fewer than
        ``MIN_CALIBRATION_TOKENS`` query tokens, and for heads whose queries carry no energy
        (an ONNX graph, for one, does not expose its queries); channels where the keys are all
        zero get weight 1.
        """
        b, h, _, d = (int(x) for x in kc.shape)
        half = half_dtype(xp)
        ones = xp.ones((b, h, d), dtype=half, device=_compat.device(kc))
        if not self.key_scale or int(q.shape[2]) < MIN_CALIBRATION_TOKENS:
            return ones
        qh, t = int(q.shape[1]), int(q.shape[2])
        qf = xp.reshape(xp.astype(q, xp.float32), (b, h, (qh // h) * t, d))
        rq = xp.sqrt(xp.mean(qf * qf, axis=2))
        rk = xp.sqrt(xp.mean(kc * kc, axis=2))
        live = rk > 0.0
        s = xp.sqrt(xp.where(live, rq / xp.where(live, rk, 1.0), 1.0))
        ms = xp.mean(s * s, axis=-1, keepdims=True)
        ok = (xp.sum(rq, axis=-1, keepdims=True) > 0.0) & (ms > 0.0) & xp.isfinite(ms)
        s = xp.where(ok, s / xp.sqrt(xp.where(ok, ms, 1.0)), 1.0)
        s = xp.clip(s, 1.0 / 16.0, 16.0)  # bounded, so that no channel is discarded or blown up
        return xp.astype(s, half)

    @staticmethod
    def _key_mean(xp: Any, calib: dict, start: int, n: int):
        """The key mean at positions ``start .. start + n - 1``: (b, h, n, d) float32 (or (b, h, 1, d)).

        A plain mean broadcasts over the tokens; a rotating one is ``R_t μ`` per position.
        """
        mu = calib["k_mean"]
        if "k_mean_freq" not in calib:
            return xp.astype(mu, xp.float32)[:, :, None, :]
        pos = xp.arange(start, start + n, dtype=xp.float64, device=_compat.device(mu))
        return rotary_mean_at(mu, calib["k_mean_freq"], calib["k_mean_pairs"], pos)

    @staticmethod
    def _selector(xp: Any, idx: Any, d: int):
        """One-hot ``(b, h, d, n_out)`` float32 matrix selecting the outlier channels."""
        ar = xp.arange(d, dtype=xp.int32, device=_compat.device(idx))
        return xp.astype(ar[None, None, :, None] == idx[:, :, None, :], xp.float32)

    def _encode(self, xp: Any, codec: dict, calib: dict, k: Any, v: Any, start: int) -> dict:
        """Quantize float32 tokens (b, h, t, d) at positions ``start ..`` -> the per-token arrays to append."""
        d = self.head_dim
        half = half_dtype(xp)
        kc = (k - self._key_mean(xp, calib, start, int(k.shape[2]))) \
            * xp.astype(calib["k_scale"], xp.float32)[:, :, None, :]
        vc = v - xp.astype(calib["v_mean"], xp.float32)[:, :, None, :]
        idx = calib["k_outlier_idx"]
        arrays = {}
        if int(idx.shape[-1]) > 0:
            sel = self._selector(xp, idx, d)
            keep = 1.0 - xp.sum(sel, axis=-1)[:, :, None, :]  # (b, h, 1, d)
            arrays["k_outliers"] = xp.astype(xp.matmul(kc, sel), half)
            kc = kc * keep
        else:
            keep = None
        kq = polar_encode(kc, codec["k_codebook"], codec["rotation"], length=self.key_length, encode=ops.polar_encode)
        vq = polar_encode(vc, codec["v_codebook"], codec["rotation"], length=self.value_length, encode=ops.polar_encode)
        arrays.update(k_codes=kq.codes, k_norms=kq.norms, v_codes=vq.codes, v_norms=vq.norms)
        if self.qjl:
            resid = kc - polar_decode(kq, codec["k_codebook"], codec["rotation"], decode=ops.polar_decode)
            if keep is not None:
                resid = resid * keep
            s = qjl_encode(resid, codec["qjl"])
            arrays.update(k_qjl=s.signs, k_qjl_norms=s.norms)
        return arrays

    def _n_sink(self, st: LayerState) -> int:
        """Sink tokens held: the first ``sink_tokens`` tokens of the layer (fewer while short)."""
        return min(self.sink_tokens, st.length)

    def _store(self, st: LayerState, k: Any, v: Any, q: Any) -> None:
        """Append new tokens: sinks, then the window, its overflow quantized (computed, then committed).

        The float16 block ``k_window`` holds the sink tokens first, then the recent tokens.
        """
        xp = st.xp
        half = half_dtype(xp)
        n_s = self._n_sink(st)
        kx, vx = st.extra["k_window"], st.extra["v_window"]
        ks, vs = kx[:, :, :n_s, :], vx[:, :, :n_s, :]
        kw, vw = kx[:, :, n_s:, :], vx[:, :, n_s:, :]
        take = min(self.sink_tokens - n_s, int(k.shape[2]))
        if take > 0:
            ks = xp.concat([ks, xp.astype(k[:, :, :take, :], half)], axis=2)
            vs = xp.concat([vs, xp.astype(v[:, :, :take, :], half)], axis=2)
            k, v = k[:, :, take:, :], v[:, :, take:, :]
            q = q[:, :, take:, :]
        n_w, t = int(kw.shape[2]), int(k.shape[2])
        first = n_s + take + st.extra["codes"].length  # position of the window's oldest token
        spill = max(0, n_w + t - self.residual_window)
        keep_new = min(t, self.residual_window)
        calib = st.extra["calib"]
        arrays = None
        if spill:
            f32 = xp.float32
            if calib is None:  # calibrate on every token held so far, then quantize the oldest
                allk = xp.concat([xp.astype(kw, f32), xp.astype(k, f32)], axis=2)
                allv = xp.concat([xp.astype(vw, f32), xp.astype(v, f32)], axis=2)
                calib = self._calibrate(xp, allk, allv, q, first)
                ek, ev = allk[:, :, :spill, :], allv[:, :, :spill, :]
            else:  # only the tokens that leave the window are converted
                old = min(spill, n_w)
                ek, ev = xp.astype(kw[:, :, :old, :], f32), xp.astype(vw[:, :, :old, :], f32)
                if spill > old:
                    ek = xp.concat([ek, xp.astype(k[:, :, :spill - old, :], f32)], axis=2)
                    ev = xp.concat([ev, xp.astype(v[:, :, :spill - old, :], f32)], axis=2)
            arrays = self._encode(xp, self._codec(xp, st.device), calib, ek, ev, first)
        drop = max(0, n_w + keep_new - self.residual_window)
        new_kx = xp.concat([ks, kw[:, :, drop:, :], xp.astype(k[:, :, t - keep_new:, :], half)], axis=2)
        new_vx = xp.concat([vs, vw[:, :, drop:, :], xp.astype(v[:, :, t - keep_new:, :], half)], axis=2)
        # Commit.
        if arrays is not None:
            st.extra["codes"].append(arrays)
        st.extra["calib"] = calib
        st.extra["k_window"], st.extra["v_window"] = new_kx, new_vx

    def _decoded(self, st: LayerState, start: int = 0) -> tuple:
        """float32 K/V of the stored tokens ``start ..``: (b, h, total - start, d) each.

        Layout: the sink tokens, the encoded tokens, the recent window; only the codes of
        tokens from ``start`` on are decoded.
        """
        xp = st.xp
        buf: TokenBuffers = st.extra["codes"]
        parts_k, parts_v = [], []
        n_s = self._n_sink(st)
        kx = xp.astype(st.extra["k_window"], xp.float32)
        vx = xp.astype(st.extra["v_window"], xp.float32)
        if start < n_s:
            parts_k.append(kx[:, :, start:n_s, :])
            parts_v.append(vx[:, :, start:n_s, :])
        c0 = min(max(0, start - n_s), buf.length)
        if buf.length > c0:
            codec = self._codec(xp, st.device)
            calib = st.extra["calib"]
            d = self.head_dim

            def view(name):
                a = buf.view(name)
                return a if c0 == 0 else a[:, :, c0:, ...]

            kq = PolarCode(view("k_codes"), view("k_norms"), self.key_bits, d)
            vq = PolarCode(view("v_codes"), view("v_norms"), self.value_bits, d)
            kd = polar_decode(kq, codec["k_codebook"], codec["rotation"], decode=ops.polar_decode)
            vd = polar_decode(vq, codec["v_codebook"], codec["rotation"], decode=ops.polar_decode)
            idx = calib["k_outlier_idx"]
            if int(idx.shape[-1]) > 0:
                sel = self._selector(xp, idx, d)
                keep = 1.0 - xp.sum(sel, axis=-1)[:, :, None, :]
                kd = kd * keep + xp.matmul(xp.astype(view("k_outliers"), xp.float32), xp.matrix_transpose(sel))
            kd = kd / xp.astype(calib["k_scale"], xp.float32)[:, :, None, :] \
                + self._key_mean(xp, calib, n_s + c0, buf.length - c0)
            vd = vd + xp.astype(calib["v_mean"], xp.float32)[:, :, None, :]
            parts_k.append(kd)
            parts_v.append(vd)
        w0 = n_s + max(0, start - n_s - buf.length)
        parts_k.append(kx[:, :, w0:, :])
        parts_v.append(vx[:, :, w0:, :])
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return xp.concat(parts_k, axis=2), xp.concat(parts_v, axis=2)

    def _qjl_bias(self, st: LayerState, q: Any, scale: float):
        """``(batch, q_heads, new_tokens, total)`` QJL logit correction, times ``scale``."""
        xp = st.xp
        buf: TokenBuffers = st.extra["codes"]
        b, qh, t, d = (int(s) for s in q.shape)
        h = self.num_kv_heads
        g = qh // h
        n_s = self._n_sink(st)
        n_q, n_w = buf.length, int(st.extra["k_window"].shape[2]) - n_s
        parts = []
        if n_s:
            parts.append(xp.zeros((b, qh, t, n_s), dtype=xp.float32, device=st.device))
        if n_q:
            sk: QJLSketch = self._codec(xp, st.device)["qjl"]
            m = sk.rows
            calib = st.extra["calib"]
            # The residual lives in the weighted, outlier-free key space: q̃ = (q / s) ⊙ keep.
            w = 1.0 / xp.astype(calib["k_scale"], xp.float32)  # (b, h, d)
            idx = calib["k_outlier_idx"]
            if int(idx.shape[-1]) > 0:
                w = w * (1.0 - xp.sum(self._selector(xp, idx, d), axis=-1))
            qt = xp.reshape(xp.astype(q, xp.float32), (b, h, g * t, d)) * w[:, :, None, :]
            sq = xp.matmul(qt, xp.matrix_transpose(sk.matrix))  # (b, h, g*t, m)
            pm = 2.0 * xp.astype(ops.unpack_bits(buf.view("k_qjl"), 1, m), xp.float32) - 1.0  # (b, h, n_q, m)
            dots = xp.matmul(sq, xp.matrix_transpose(pm))  # (b, h, g*t, n_q)
            w = xp.astype(buf.view("k_qjl_norms"), xp.float32) * (scale * QJL_SCALE / m)
            parts.append(xp.reshape(dots * w[:, :, None, :], (b, qh, t, n_q)))
        if n_w:
            parts.append(xp.zeros((b, qh, t, n_w), dtype=xp.float32, device=st.device))
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=3)

    def _result(self, st: LayerState, q: Any, scale: float) -> DequantResult:
        xp = st.xp
        k, v = self._decoded(st)
        bias = self._qjl_bias(st, q, scale) if self.qjl and st.extra["codes"].length else None
        return DequantResult(k=xp.astype(k, st.dtype), v=xp.astype(v, st.dtype),
                             logit_bias=None if bias is None else xp.astype(bias, q.dtype))

    # -- hooks -----------------------------------------------------------------------
    def _prefill(self, st, k, v, q):
        first = st.length == 0
        self._store(st, k, v, q)
        if first:
            return DequantResult(k=k, v=v)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        return self._result(st, q, scale)

    def _decode(self, st, k, v, q, config: AttendConfig):
        self._store(st, k, v, q)
        if self._fused(st.xp):
            return Fused(ops.polar_decode_attention(self._codec_state(st), q, config.softmax_scale))
        return Dequantized(self._result(st, q, config.softmax_scale))

    def _fused_auto(self, xp: Any) -> bool:
        return ops.has_kernel("polar_decode_attention", xp)

    def _dequantize(self, st) -> DequantResult:
        return self._dequantize_from(st, 0)

    def _dequantize_from(self, st, start: int) -> DequantResult:
        xp = st.xp
        k, v = self._decoded(st, start)
        return DequantResult(k=xp.astype(k, st.dtype), v=xp.astype(v, st.dtype))

    def _append_tokens(self, st, k, v, q) -> None:
        self._store(st, k, v, q)

    def _stable_length(self, st) -> int:
        return self._n_sink(st) + st.extra["codes"].length  # sinks and codes never change; the window does

    def _layer_arrays(self, st) -> dict:
        out = dict(st.extra["codes"].arrays())
        out["k_window"] = st.extra["k_window"]
        out["v_window"] = st.extra["v_window"]
        if st.extra["calib"] is not None:
            out.update(st.extra["calib"])
        return out

    def _restore_layer(self, xp, dev, batch, dtype, length, arrays) -> LayerState:
        st = self._new_layer(xp, dev, batch, dtype)
        names = ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers", "k_qjl", "k_qjl_norms")
        per_token = {n: arrays[n] for n in names if n in arrays}
        if per_token and int(per_token["k_codes"].shape[2]):
            st.extra["codes"].append(per_token)
        st.extra["k_window"] = xp.asarray(arrays["k_window"], copy=True)
        st.extra["v_window"] = xp.asarray(arrays["v_window"], copy=True)
        if "k_mean" in arrays:
            st.extra["calib"] = {n: xp.asarray(arrays[n], copy=True)
                                 for n in ("k_mean", "v_mean", "k_scale", "k_outlier_idx", "k_mean_freq",
                                           "k_mean_pairs") if n in arrays}
        held = st.extra["codes"].length + int(st.extra["k_window"].shape[2])
        if held != length:
            raise ValueError(f"stored arrays hold {held} "
                             f"tokens, expected {length}")
        st.length = length
        return st

    def _side_nbytes(self, st) -> int:
        total = _compat.array_nbytes(st.extra["k_window"]) + _compat.array_nbytes(st.extra["v_window"])
        if st.extra["calib"] is not None:
            total += sum(_compat.array_nbytes(a) for a in st.extra["calib"].values())
        return total

    def _layer_nbytes(self, st) -> int:
        return st.extra["codes"].used_nbytes() + self._side_nbytes(st)

    def _layer_reserved_nbytes(self, st) -> int:
        return st.extra["codes"].reserved_nbytes() + self._side_nbytes(st)

    # -- inspection for kernels ------------------------------------------------------
    def layer_codec_state(self, layer: int) -> PolarLayerCodec | None:
        """The arrays of ``layer`` as a :class:`PolarLayerCodec` (views, not copies), or None if empty.

        Valid until the next call that changes the layer; read, never write.
        """
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            return None if st is None else self._codec_state(st)

    def _codec_state(self, st: LayerState) -> PolarLayerCodec:
        """:meth:`layer_codec_state` of a layer whose lock the caller holds."""
        codec = self._codec(st.xp, st.device)
        buf: TokenBuffers = st.extra["codes"]
        calib = st.extra["calib"] or {}
        d = self.head_dim

        def view(name, tail):
            if name in buf.names():
                return buf.view(name)
            shape = (st.batch, self.num_kv_heads, 0) + tail
            return st.xp.zeros(shape, dtype=st.xp.uint8 if "codes" in name or name == "k_qjl"
                               else half_dtype(st.xp), device=st.device)

        has_out = "k_outlier_idx" in calib and int(calib["k_outlier_idx"].shape[-1]) > 0
        return PolarLayerCodec(
            n_sink=self._n_sink(st),
            n_quantized=buf.length, n_window=int(st.extra["k_window"].shape[2]),
            rotation=codec["rotation"], k_codebook=codec["k_codebook"], v_codebook=codec["v_codebook"],
            k_codes=view("k_codes", (packed_nbytes(d, self.key_bits),)), k_norms=view("k_norms", ()),
            v_codes=view("v_codes", (packed_nbytes(d, self.value_bits),)), v_norms=view("v_norms", ()),
            k_mean=calib.get("k_mean"), v_mean=calib.get("v_mean"), k_scale=calib.get("k_scale"),
            k_mean_freq=calib.get("k_mean_freq"), k_mean_pairs=calib.get("k_mean_pairs"),
            k_outlier_idx=calib["k_outlier_idx"] if has_out else None,
            k_outliers=buf.view("k_outliers") if has_out and "k_outliers" in buf.names() else None,
            k_window=st.extra["k_window"], v_window=st.extra["v_window"],
            qjl=codec["qjl"],
            k_qjl=view("k_qjl", (packed_nbytes(d, 1),)) if self.qjl else None,
            k_qjl_norms=view("k_qjl_norms", ()) if self.qjl else None)


def _register(name: str, key_bits: int, value_bits: int, qjl: bool) -> None:
    def factory(*, num_layers, num_kv_heads, head_dim, key_bits: int = key_bits, value_bits: int = value_bits,
                **options):
        cache = PolarCache(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           key_bits=key_bits, value_bits=value_bits, qjl=qjl, **options)
        cache.method = name
        return cache

    factory.__name__ = f"make_{name}"
    factory.__doc__ = (f"``{name}``: keys {key_bits} bits{' + 1-bit QJL' if qjl else ''}, values {value_bits} bits; "
                       "options of :class:`PolarCache`.")
    register_method(name)(factory)


for _b in (2, 3, 4):
    _register(f"pqo{_b}", _b, _b, False)
    _register(f"pq{_b}", _b - 1, _b - 1, False)
    _register(f"tq{_b}", _b - 1, _b - 1, True)
