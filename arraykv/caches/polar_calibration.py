"""Calibration of a polar cache layer: means, key channel weights and outlier channels.

A layer is calibrated once, on every token it holds at the moment its first token must be
quantized (normally the first prefill): a per-head per-channel mean is subtracted from keys
and values when it carries a noticeable share of their energy (for keys with rotary
embeddings, a mean that turns with the position: :mod:`arraykv.quant.rotary_mean`), key
channels are weighted by ``sqrt(rms_q / rms_k)``, and the key channels whose magnitude stands
out are kept exactly. The measurements behind the thresholds are in ``docs/algorithms.md``.

:func:`calibration_layout` is what a saved calibration must be before a layer is rebuilt
from it (:mod:`arraykv.caches.layout`): the shapes and dtypes of :class:`PolarCalibration`,
finite values, key channel weights inside the ``[1/16, 16]`` that :func:`query_scale` clips
to (a kernel divides by them), fewer than ``head_dim`` outlier channels, strictly ascending in
``[0, head_dim)``, frequencies in ``[0, π]`` and channel pairs of one of the rotary layouts
(:func:`~arraykv.quant.rotary_mean.rope_pairs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import _compat
from .._types import Array, Namespace
from ..quant.polar import half_dtype
from ..quant.rotary_mean import ROPE_LAYOUTS, RotaryMeanPlan, fit_rotary_mean, rope_pairs
from .layout import Layout, Spec, check_layout
from .polar_options import PolarOptions

__all__ = [
    "PolarCalibration",
    "calibrate",
    "calibration_layout",
    "CENTER_MIN_SHARE",
    "MIN_CALIBRATION_TOKENS",
    "KEY_SCALE_RANGE",
]

#: Centering is used when the mean carries more than this share of the vectors' energy.
CENTER_MIN_SHARE = 0.02
#: Fewer calibration tokens than this: no centering and no "auto" outlier channels.
MIN_CALIBRATION_TOKENS = 8
#: Key channel weights are clipped to this range (:func:`query_scale`).
KEY_SCALE_RANGE = (1.0 / 16.0, 16.0)


@dataclass(frozen=True)
class PolarCalibration:
    """The per-head statistics of a calibrated layer (arrays of shape (batch, kv_heads, ...)).

    Attributes
    ----------
    k_mean, v_mean : float16 (b, h, d)
        Means subtracted before encoding (zeros where centering is off); ``k_mean`` is the key
        mean at position 0 when ``k_mean_freq`` is set.
    k_scale : float16 (b, h, d)
        Key channel weights ``s``: keys are encoded as ``s ⊙ (k − m_t)``.
    k_outlier_idx : int32 (b, h, n_out)
        Key channels kept exactly, ascending.
    k_mean_freq : float32 (b, h, d // 2) or None
        Angular frequency of each channel pair of a rotating key mean.
    k_mean_pairs : int32 (d // 2, 2) or None
        The channels of each pair.
    """

    k_mean: Array
    v_mean: Array
    k_scale: Array
    k_outlier_idx: Array
    k_mean_freq: Array | None = None
    k_mean_pairs: Array | None = None

    #: Array names as saved (the on-disk names of the file format).
    NAMES = ("k_mean", "v_mean", "k_scale", "k_outlier_idx", "k_mean_freq", "k_mean_pairs")

    def arrays(self) -> dict:
        """The arrays held, by name (the rotating-mean ones only when set)."""
        return {n: getattr(self, n) for n in self.NAMES if getattr(self, n) is not None}

    @classmethod
    def from_arrays(cls, xp: Namespace, arrays: dict[str, Array]) -> PolarCalibration | None:
        """Copies of the calibration arrays in ``arrays`` (None when it holds none), checked
        against :func:`calibration_layout` first (``ValueError``): a kernel divides by the key
        channel weights and indexes by the outlier channels and pairs."""
        if "k_mean" not in arrays:
            return None
        held = {n: arrays[n] for n in cls.NAMES if n in arrays}
        shape = tuple(int(s) for s in getattr(held["k_mean"], "shape", ()))
        if len(shape) != 3:
            raise ValueError(f"stored array 'k_mean' must be (batch, kv_heads, head_dim), received shape {shape}")
        check_layout(xp, held, calibration_layout(xp, *shape))
        return cls(**{n: xp.asarray(a, copy=True) for n, a in held.items()})

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(_compat.array_nbytes(a) for a in self.arrays().values())

    @property
    def n_outliers(self) -> int:
        """Outlier channels per head."""
        return int(self.k_outlier_idx.shape[-1])

    def key_mean(self, xp: Namespace, start: int, n: int) -> Array:
        """The key mean at positions ``start .. start + n - 1``: (b, h, n, d) float32, or (b, h, 1, d).

        A plain mean broadcasts over the tokens; a rotating one is ``R_t μ`` per position.
        """
        if self.k_mean_freq is None:
            return xp.astype(self.k_mean, xp.float32)[:, :, None, :]
        pos = xp.arange(start, start + n, dtype=xp.float64, device=_compat.device(self.k_mean))
        plan = self.rotary_plan()
        assert plan is not None  # k_mean_freq is set
        return plan.at(pos)

    def rotary_plan(self) -> RotaryMeanPlan | None:
        """The layer's :class:`RotaryMeanPlan` (None without a rotating key mean), made on first use.

        Made once per layer (the arrays never change): not a field, not saved.
        """
        if self.k_mean_freq is None:
            return None
        plan = self.__dict__.get("_rotary_plan")
        if plan is None:
            plan = RotaryMeanPlan(self.k_mean, self.k_mean_freq, self.k_mean_pairs)
            object.__setattr__(self, "_rotary_plan", plan)
        return plan


def calibrate(opts: PolarOptions, xp: Namespace, k: Array, v: Array, q: Array, start: int) -> PolarCalibration:
    """Per-head statistics of float32 tokens ``k``, ``v`` (b, h, n, d) with queries ``q`` (b, qh, n, d).

    ``start`` is the position of the first token. With fewer than
    :data:`MIN_CALIBRATION_TOKENS` tokens the means are zero and ``"auto"`` selects no outlier
    channel (one token says nothing about channel statistics).
    """
    d = int(k.shape[-1])
    half = half_dtype(xp)
    dev = _compat.device(k)
    out = {}
    few = int(k.shape[2]) < MIN_CALIBRATION_TOKENS
    rm = fit_rotary_mean(k, start, rope=opts.rope if opts.center is not False and not few else None)
    for name, x in (("k", k), ("v", v)):
        mu = rm.mean if name == "k" else xp.mean(x, axis=2)
        removed = xp.sum(mu * mu, axis=-1)  # |R_t mu|^2 = |mu|^2 at every position
        use = xp.ones(tuple(mu.shape[:2]), dtype=xp.bool, device=dev)
        if few or not opts.center:
            use = xp.zeros_like(use)
        elif opts.center == "auto":
            energy = xp.mean(xp.sum(x * x, axis=-1), axis=2)
            use = removed > CENTER_MIN_SHARE * energy
        out[name + "_mean"] = xp.astype(xp.where(use[..., None], mu, xp.zeros_like(mu)), half)
        if name == "k" and rm.layout is not None:
            out["k_mean_freq"] = xp.where(use[..., None], rm.freq, xp.zeros_like(rm.freq))
            out["k_mean_pairs"] = rm.pairs
    placeholder = xp.zeros((1, 1, 0), dtype=xp.int32, device=dev)
    partial = PolarCalibration(k_scale=None, k_outlier_idx=placeholder, **out)
    kc = k - partial.key_mean(xp, start, int(k.shape[2]))
    k_scale = query_scale(opts, xp, q, kc)
    # (b, h, d): channel RMS of what is quantized, the weighted centered keys s * (k - m_t)
    rms = xp.sqrt(xp.mean(kc * kc, axis=2)) * xp.astype(k_scale, xp.float32)
    if opts.outliers == "auto" and few:
        n_out = 0
    elif opts.outliers == "auto":
        med = xp.sort(rms, axis=-1)[..., d // 2]
        count = xp.sum(xp.astype(rms > opts.outlier_threshold * med[..., None], xp.int32), axis=-1)
        n_out = min(opts.max_outliers, int(xp.max(count)))
    else:
        n_out = opts.outliers
    if n_out > 0:
        order = xp.argsort(rms, axis=-1, descending=True, stable=True)[..., :n_out]
        idx = xp.astype(xp.sort(order, axis=-1), xp.int32)
    else:
        idx = xp.zeros(tuple(rms.shape[:2]) + (0,), dtype=xp.int32, device=dev)
    return PolarCalibration(k_scale=k_scale, k_outlier_idx=idx, **out)


def query_scale(opts: PolarOptions, xp: Namespace, q: Array, kc: Array) -> Array:
    """Per-head key channel weights ``s = sqrt(rms_q / rms_k)`` (b, h, d), half precision.

    ``rms_q`` is the RMS of the group's calibration queries in each channel, ``rms_k`` that
    of the centered keys ``kc``. Weights are normalized to mean square 1 per head and
    clipped to [1/16, 16]. Ones when ``key_scale`` is off, with fewer than
    :data:`MIN_CALIBRATION_TOKENS` query tokens, and for heads whose queries carry no energy
    (an ONNX graph, for one, does not expose its queries); channels where the keys are all
    zero get weight 1.
    """
    b, h, _, d = (int(x) for x in kc.shape)
    half = half_dtype(xp)
    ones = xp.ones((b, h, d), dtype=half, device=_compat.device(kc))
    if not opts.key_scale or int(q.shape[2]) < MIN_CALIBRATION_TOKENS:
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
    s = xp.clip(s, *KEY_SCALE_RANGE)  # bounded, so that no channel is discarded or blown up
    return xp.astype(s, half)


def calibration_layout(xp: Namespace, batch: int, heads: int, head_dim: int) -> Layout:
    """The saved calibration arrays of a layer (see the module docstring), all optional together.

    Binds the size ``"n_out"`` (outlier channels); ``groups`` holds the calibration's names,
    and the rotating-mean pair, which needs the calibration too (a rule).
    """
    half, d = half_dtype(xp), head_dim
    lead = (batch, heads)
    arrays = {
        "k_mean": Spec(half, lead + (d,), required=False),
        "v_mean": Spec(half, lead + (d,), required=False),
        "k_scale": Spec(half, lead + (d,), required=False, low=KEY_SCALE_RANGE[0], high=KEY_SCALE_RANGE[1]),
        "k_outlier_idx": Spec(xp.int32, lead + ("n_out",), required=False, low=0, high=d - 1, ascending=True),
        "k_mean_freq": Spec(xp.float32, lead + (d // 2,), required=False, low=0.0, high=math.pi),
        "k_mean_pairs": Spec(xp.int32, (d // 2, 2), required=False),
    }

    def pieces(sizes: dict[str, int], held: frozenset[str]) -> str | None:
        if "k_mean_freq" in held and "k_mean" not in held:
            return "stored 'k_mean_freq' and 'k_mean_pairs' need the rest of the calibration"
        if sizes.get("n_out", 0) >= d:
            return f"stored 'k_outlier_idx' must name fewer than head_dim={d} channels, received {sizes['n_out']}"
        return None

    def pairs(xp: Namespace, sizes: dict[str, int], arrays: dict[str, Array]) -> str | None:
        got = arrays.get("k_mean_pairs")
        if got is None:
            return None
        if d % 2 == 0 and any(
            bool(xp.all(got == rope_pairs(d, layout, xp=xp, device=_compat.device(got)))) for layout in ROPE_LAYOUTS
        ):
            return None
        return f"stored 'k_mean_pairs' must be the channel pairs of a rotary layout ({', '.join(ROPE_LAYOUTS)})"

    return Layout(
        arrays=arrays,
        groups=(PolarCalibration.NAMES[:4], ("k_mean_freq", "k_mean_pairs")),
        rules=(pieces,),
        value_rules=(pairs,),
    )
