"""What a kernel reads of a polar cache layer, and the fixed arrays of a polar cache.

:class:`PolarLayerCodec` is the packed state of one layer (views of the cache's arrays, no
copies) that the fused decode attention reads (:mod:`arraykv.attention.polar_fused` and the
kernels under it); :class:`PolarFixed` is the rotation, codebooks and QJL sketch a cache holds
once per namespace and device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._types import Array, Device, Namespace
from ..quant.codebooks import Codebook, make_codebook
from ..quant.polar_encoder import PolarEncoder
from ..quant.qjl import QJLSketch, make_sketch
from ..quant.rotation import Rotation, make_rotation

if TYPE_CHECKING:
    from ..quant.rotary_mean import RotaryMeanPlan
    from .polar_calibration import PolarCalibration

__all__ = ["PolarLayerCodec", "PolarFixed", "layer_codec"]


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
    one block of exact tokens: one query's attention does not depend on the order of keys. For
    TurboQuant-prod keys the logit of query ``q`` gains
    ``softmax_scale · √(π/2)/m · k_qjl_norms[b,h,t] · ⟨S q̃, ±1(k_qjl[b,h,t])⟩`` with
    ``q̃ = q / k_scale[b,h]`` and the outlier channels of ``q̃`` set to zero (the residual lives in
    the weighted key space without them).

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
    k_mean_plan : RotaryMeanPlan or None
        The position-independent part of the rotating key mean, made once per layer
        (:meth:`~arraykv.quant.rotary_mean.RotaryMeanPlan.logits` gives its share of every
        logit); None without ``k_mean_freq``, or where the caller built the codec itself.
    """

    n_sink: int
    n_quantized: int
    n_window: int
    rotation: Rotation
    k_codebook: Codebook
    v_codebook: Codebook
    k_codes: Array
    k_norms: Array
    v_codes: Array
    v_norms: Array
    k_mean: Array
    v_mean: Array
    k_scale: Array
    k_mean_freq: Array
    k_mean_pairs: Array
    k_outlier_idx: Array
    k_outliers: Array
    k_window: Array
    v_window: Array
    qjl: QJLSketch | None
    k_qjl: Array
    k_qjl_norms: Array
    k_mean_plan: RotaryMeanPlan | None = None


def layer_codec(**values: object) -> PolarLayerCodec:
    """``PolarLayerCodec(**values)`` (every field given but ``k_mean_plan``, which defaults to
    None), made without the frozen dataclass's per-field ``object.__setattr__`` (a decode step
    makes one)."""
    codec = object.__new__(PolarLayerCodec)
    held = codec.__dict__
    held["k_mean_plan"] = None
    held.update(values)
    if len(codec.__dict__) != _CODEC_FIELDS:
        raise TypeError(f"layer_codec needs every field of PolarLayerCodec, received {sorted(values)}")
    return codec


_CODEC_FIELDS = len(PolarLayerCodec.__dataclass_fields__)


@dataclass(frozen=True)
class PolarFixed:
    """The arrays a polar cache holds once per namespace and device, whatever it stores.

    Attributes
    ----------
    rotation : Rotation
        The seeded random rotation ``M`` (head_dim × head_dim, or its Hadamard form).
    k_codebook, v_codebook : Codebook
        Lloyd-Max centroids for ``key_bits`` and ``value_bits``.
    qjl : QJLSketch or None
        The seeded Gaussian sketch of TurboQuant-prod keys.
    """

    rotation: Rotation
    k_codebook: Codebook
    v_codebook: Codebook
    qjl: QJLSketch | None

    @classmethod
    def build(
        cls, xp: Namespace, dev: Device, *, head_dim: int, key_bits: int, value_bits: int, seed: int, qjl: bool
    ) -> PolarFixed:
        """The arrays for one namespace and device (same seed, same arrays; keys and values of
        the same bits share one codebook, as :meth:`nbytes` counts it)."""
        k_codebook = make_codebook(key_bits, head_dim, xp=xp, device=dev)
        return cls(
            rotation=make_rotation(head_dim, seed, xp=xp, device=dev),
            k_codebook=k_codebook,
            v_codebook=k_codebook if value_bits == key_bits else make_codebook(value_bits, head_dim, xp=xp, device=dev),
            qjl=make_sketch(head_dim, seed, xp=xp, device=dev) if qjl else None,
        )

    def encoder(self, calib: PolarCalibration, *, key_length: str, value_length: str, qjl: bool) -> PolarEncoder:
        """The encode ops' argument object for a layer calibrated with ``calib``
        (a :class:`~arraykv.caches.polar_calibration.PolarCalibration`).

        ``key_length``/``value_length`` are the options' ``"unbiased"`` or ``"norm"``; ``qjl``
        says whether the keys' residual is sketched (this set's sketch then).
        """
        return PolarEncoder(
            k_mean=calib.k_mean,
            v_mean=calib.v_mean,
            k_scale=calib.k_scale,
            k_outlier_idx=calib.k_outlier_idx,
            k_mean_freq=calib.k_mean_freq,
            k_mean_pairs=calib.k_mean_pairs,
            k_codebook=self.k_codebook,
            v_codebook=self.v_codebook,
            rotation=self.rotation,
            key_unbiased=key_length == "unbiased",
            value_unbiased=value_length == "unbiased",
            qjl=self.qjl if qjl else None,
        )

    def nbytes(self) -> int:
        """Bytes held (a codebook shared by keys and values counted once)."""
        total = self.rotation.nbytes + self.k_codebook.nbytes
        if self.v_codebook.bits != self.k_codebook.bits:
            total += self.v_codebook.nbytes
        if self.qjl is not None:
            total += self.qjl.nbytes
        return total
