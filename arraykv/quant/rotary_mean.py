"""The mean of rotary-embedded keys: a constant vector turned by the position's rotation.

Models with rotary position embedding (RoPE) hand a cache the keys ``k_t = R_t k'_t``, where
``k'_t`` is what the projection produced and ``R_t`` turns each channel pair ``(a, b)`` by the
angle ``ω_j t``. The projected keys ``k'_t`` share a large mean ``μ`` (on SmolLM2-135M it carries
50–95 % of their energy), but after the rotation that mean is a different vector at every
position: ``R_t μ`` spins at ``ω_j`` in pair ``j``. A per-channel mean of the rotated keys only
catches the pairs that turn slowly; the rest stays in what is quantized. Subtracting ``R_t μ``
instead leaves 3–6× less energy to quantize, which is worth one to two bits of key precision.

Functions here are pure (array API):

:func:`fit_rotary_mean`
    ``μ`` (as it is at position 0) and the angular frequency of each pair, from keys at known
    positions; the rotary convention (pair layout and frequency base) is given or found by
    trying the usual ones.
:func:`rotary_mean_at`
    ``R_t μ`` at any positions.

A pair whose rotating mean removes less energy than a plain mean of its two channels gets
frequency 0: it is then exactly the per-channel mean (``R_t`` with ``ω = 0`` is the identity),
so the plain centering of earlier versions is the special case with every frequency 0.

Notes
-----
RoPE (Su et al., 2021, *RoFormer*): pair ``j`` of ``d/2`` pairs turns by ``ω_j = θ^(−2j/d)``
per position, ``θ`` the base (10 000 in the paper; 100 000 for SmolLM2, 500 000 for
Llama 3). The pairs are channels ``(j, j + d/2)`` ("half", the rotate-half layout of most
checkpoints) or ``(2j, 2j + 1)`` ("interleaved"). For one pair written as a complex number
``z_t = k_a + i k_b``, the keys are ``z_t = e^{iω t} z'_t``; the least-squares fit of
``z_t ≈ e^{iω t} μ`` is ``μ = mean_t(e^{−iω t} z_t)`` and it removes ``n |μ|²`` of the
energy ``Σ_t |z_t|²``, which is what candidate conventions are compared by.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._types import Array, Device, Namespace
from .._validation import check_real

__all__ = [
    "RotaryMeanPlan",
    "ROPE_LAYOUTS",
    "RotaryMean",
    "rope_pairs",
    "rope_frequencies",
    "fit_rotary_mean",
    "rotary_mean_at",
    "check_rope",
]

#: Channel pairings of rotary embeddings: ``(j, j + d/2)`` or ``(2j, 2j + 1)``.
ROPE_LAYOUTS = ("half", "interleaved")
#: Bases tried first by ``rope="auto"`` (the published ones); a grid and a refinement follow.
_KNOWN_BASES = (10000.0, 50000.0, 100000.0, 500000.0, 1000000.0, 5000000.0, 10000000.0)
#: Coarse grid of bases: 4 per decade from 10^3 to 10^8.
_GRID = tuple(10.0 ** (3.0 + i / 4.0) for i in range(21))
#: Calibration tokens used to choose the convention (the first ones; the fit uses them all).
_DETECT_TOKENS = 1024
#: Fewer calibration tokens than this: no rotating mean (the convention cannot be told apart).
MIN_TOKENS = 32
#: A convention is used only when it removes this share of the energy more than plain means.
MIN_GAIN = 0.02


@dataclass(frozen=True)
class RotaryMean:
    """A rotating mean: ``m_t = R_t μ`` for the keys at position ``t``.

    Attributes
    ----------
    mean : array, shape (batch, heads, d), float32
        ``μ``, the mean as it is at position 0 (channel layout of the keys).
    freq : array, shape (batch, heads, d // 2), float32
        ``ω_j`` in radians per position; 0 for a pair with a plain (constant) mean.
    pairs : array, shape (d // 2, 2), int32
        Channels ``(a, b)`` of each pair: ``m_t[a] = μ_a cos ω t − μ_b sin ω t`` and
        ``m_t[b] = μ_b cos ω t + μ_a sin ω t``.
    layout : str or None
        The convention found (``"half"``/``"interleaved"``) or None when every frequency is 0.
    base : float or None
        Its frequency base ``θ`` (None when every frequency is 0).
    """

    mean: Array
    freq: Array
    pairs: Array
    layout: str | None
    base: float | None


def check_rope(value: Any) -> Any:
    """Validate a ``rope`` option: ``"auto"``, None, or ``{"theta": float, "layout": str}``."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, Mapping):
        keys = set(value)
        if keys != {"theta", "layout"}:
            raise ValueError(f"rope must have exactly the keys 'theta' and 'layout', received {sorted(keys)}")
        try:
            theta = check_real("rope['theta']", value["theta"], low=1.0, low_open=True)
        except TypeError as exc:  # every malformed rope option is a ValueError
            raise ValueError(str(exc)) from None
        if value["layout"] not in ROPE_LAYOUTS:
            raise ValueError(f"rope['layout'] must be one of {', '.join(ROPE_LAYOUTS)}, received {value['layout']!r}")
        return {"theta": float(theta), "layout": str(value["layout"])}
    raise ValueError(f"rope must be 'auto', None or a dict with 'theta' and 'layout', received {value!r}")


def rope_pairs(d: int, layout: str, *, xp: Namespace, device: Device | None = None) -> Array:
    """Channel pairs ``(d // 2, 2)`` int32 of the rotary ``layout`` for ``d`` (even) channels."""
    half = d // 2
    j = xp.arange(half, dtype=xp.int32, device=device)
    if layout == "half":
        return xp.stack([j, j + half], axis=1)
    if layout == "interleaved":
        return xp.stack([2 * j, 2 * j + 1], axis=1)
    raise ValueError(f"layout must be one of {', '.join(ROPE_LAYOUTS)}, received {layout!r}")


def rope_frequencies(d: int, base: float) -> list:
    """``ω_j = base^(−2j/d)`` for ``j < d/2``, as Python floats (radians per position)."""
    return [float(base) ** (-2.0 * j / d) for j in range(d // 2)]


def _phases(xp: Namespace, freq: Array, positions: Array, exact: bool = True) -> tuple[Array, Array]:
    """cos and sin of ``freq · positions`` (float32), the product formed in float64.

    ``freq`` (..., J) and ``positions`` (n,) broadcast to (..., n, J). Positions reach 10⁵ and
    more, where float32 angles are off by a tenth of a radian; ``exact=False`` (positions
    below about 10⁴, where float32 is within 10⁻³ rad) computes in float32, several times faster.
    """
    dt = xp.float64 if exact else xp.float32
    ang = xp.astype(positions, dt)[:, None] * xp.astype(freq, dt)[..., None, :]
    if not exact:
        return xp.cos(ang), xp.sin(ang)
    return xp.astype(xp.cos(ang), xp.float32), xp.astype(xp.sin(ang), xp.float32)


def _demodulated_means(xa: Array, xb: Array, c: Array, s: Array) -> tuple[Array, Array]:
    """``mean_t R(−ω t) (x_a, x_b)``: the rotating mean of each pair, (..., J) twice."""
    xp = _compat.namespace(xa)
    ma = xp.mean(xa * c + xb * s, axis=-2)
    mb = xp.mean(xb * c - xa * s, axis=-2)
    return ma, mb


def _fit(x: Array, positions: Array, pairs: Array, freq: Array) -> tuple[Array, Array, Array]:
    """Per-pair rotating means for frequencies ``freq`` (J,) and the energy each removes, (b, h, J)."""
    xp = _compat.namespace(x)
    xa = xp.take(x, pairs[:, 0], axis=3)
    xb = xp.take(x, pairs[:, 1], axis=3)
    c, s = _phases(xp, freq, positions)
    ma, mb = _demodulated_means(xa, xb, c, s)
    return ma, mb, ma * ma + mb * mb


def fit_rotary_mean(x: Array, start: int, *, rope: dict[str, Any] | str | None = "auto") -> RotaryMean:
    """Fit ``m_t = R_t μ`` to keys ``x`` at positions ``start, start + 1, ...``.

    Parameters
    ----------
    x : array, shape (batch, heads, n, d), float32
        Keys as the model hands them (rotary embedding applied), in position order.
    start : int
        Position of ``x[:, :, 0]``. Any constant offset between the cache's count and the
        model's positions is absorbed into ``μ``.
    rope : "auto", None or dict
        ``{"theta": base, "layout": "half" | "interleaved"}`` fixes the convention; ``"auto"``
        tries the usual layouts and bases (see Notes) and keeps the best; None fits plain
        per-channel means (every frequency 0).

    Returns
    -------
    RotaryMean

    Notes
    -----
    ``"auto"`` scores each (layout, base) by the energy its per-pair best fit removes
    (rotating or plain, whichever removes more in that pair), over the first 1 024 tokens of
    the first sequence: the published bases, 4 bases per decade from 10³ to 10⁸, then two
    refinements around the best. The winner is used only if it removes at least 2 % of the keys' energy more than
    plain means; below :data:`MIN_TOKENS` tokens, or for odd ``d``, every frequency is 0.
    """
    xp = _compat.namespace(x)
    dev = _compat.device(x)
    b, h, n, d = (int(s) for s in x.shape)
    half = d // 2
    rope = check_rope(rope)
    positions = xp.arange(start, start + n, dtype=xp.float64, device=dev)
    static = xp.mean(x, axis=2)  # (b, h, d)
    if d % 2 or half == 0:
        return RotaryMean(
            static,
            xp.zeros((b, h, half), dtype=xp.float32, device=dev),
            xp.zeros((half, 2), dtype=xp.int32, device=dev),
            None,
            None,
        )
    layout: str | None
    base: float | None
    layout, base = None, None
    if rope is not None and n >= MIN_TOKENS:
        if isinstance(rope, Mapping):
            layout, base = rope["layout"], rope["theta"]
        else:
            m = min(n, _DETECT_TOKENS)
            # detection needs the relative positions only: count from 0 (float32 angles stay exact)
            layout, base = _detect(x[:, :, :m, :], positions[:m] - float(start), static)
    pairs = rope_pairs(d, layout or "half", xp=xp, device=dev)
    if layout is None:
        return RotaryMean(static, xp.zeros((b, h, half), dtype=xp.float32, device=dev), pairs, None, None)
    assert base is not None  # found or given with the layout
    freq = xp.asarray(rope_frequencies(d, base), dtype=xp.float32, device=dev)
    ma, mb, e_rot = _fit(x, positions, pairs, freq)
    sa = xp.take(static, pairs[:, 0], axis=2)
    sb = xp.take(static, pairs[:, 1], axis=2)
    use = e_rot > sa * sa + sb * sb  # (b, h, J): the rotating mean removes more in this pair
    ma, mb = xp.where(use, ma, sa), xp.where(use, mb, sb)
    freq_bh = xp.where(use, freq[None, None, :], xp.zeros_like(ma))
    # scatter the pair means back to channel order
    onehot_a = xp.astype(xp.arange(d, dtype=xp.int32, device=dev)[None, :] == pairs[:, 0:1], xp.float32)  # (J, d)
    onehot_b = xp.astype(xp.arange(d, dtype=xp.int32, device=dev)[None, :] == pairs[:, 1:2], xp.float32)
    mean = xp.matmul(ma, onehot_a) + xp.matmul(mb, onehot_b)
    return RotaryMean(mean, freq_bh, pairs, layout, float(base))


def _detect(x: Array, positions: Array, static: Array) -> tuple[str | None, float | None]:
    """``(layout, base)`` of the best convention for ``x``, or ``(None, None)`` (plain means win)."""
    xp = _compat.namespace(x)
    dev = _compat.device(x)
    d = int(x.shape[3])
    xs = x[:1, ...]  # the convention is the model's: one sequence of the batch tells it
    st = xp.mean(xs, axis=2)
    energy = float(xp.sum(xp.mean(xs * xs, axis=2)))
    plain = float(xp.sum(st * st))
    if energy <= 0.0:
        return None, None
    best: tuple[float, str | None, float | None] = (plain, None, None)
    layout: str | None
    base: float | None
    for layout in ROPE_LAYOUTS:
        pairs = rope_pairs(d, layout, xp=xp, device=dev)
        xa = xp.take(xs, pairs[:, 0], axis=3)[:, :, None, :, :]  # (1, h, 1, n, J)
        xb = xp.take(xs, pairs[:, 1], axis=3)[:, :, None, :, :]
        sa = xp.take(st, pairs[:, 0], axis=2)
        sb = xp.take(st, pairs[:, 1], axis=2)
        e_static = (sa * sa + sb * sb)[:, :, None, :]  # (1, h, 1, J)

        def scores(
            bases: list[float], xa: Array = xa, xb: Array = xb, e_static: Array = e_static
        ) -> dict[float, float]:
            freq = xp.asarray([rope_frequencies(d, b) for b in bases], dtype=xp.float32, device=dev)  # (C, J)
            c, s = _phases(xp, freq, positions, exact=False)  # (C, n, J); positions < 1024 + start
            ma, mb = _demodulated_means(xa, xb, c, s)  # (1, h, C, J)
            total = xp.sum(xp.maximum(ma * ma + mb * mb, e_static), axis=(0, 1, 3))
            return {b: float(v) for b, v in zip(bases, _compat.to_numpy(total).tolist())}

        tried = scores(list(_KNOWN_BASES + _GRID))
        top = max(tried, key=tried.get)  # type: ignore[arg-type]  # every key is there
        step = 10.0 ** (1.0 / 4.0)
        for _ in range(2):  # refine around the best: a grid 4x finer each round
            step = step**0.25
            tried.update(scores([top * step**k for k in range(-4, 5) if k]))
            top = max(tried, key=tried.get)  # type: ignore[arg-type]
        if tried[top] > best[0]:
            best = (tried[top], layout, top)
    removed, layout, base = best
    if layout is None or removed - plain < MIN_GAIN * energy:
        return None, None
    assert base is not None  # found with the layout
    # a published base within the refinement's resolution is what the model uses
    for known in _KNOWN_BASES:
        if abs(math.log(base / known)) < 0.03:
            base = known
    return layout, float(base)


class RotaryMeanPlan:
    """The position-independent part of :func:`rotary_mean_at` for one layer, computed once.

    ``at(positions)`` is ``R_t μ`` at those positions: the cos/sin of each pair's angle, the
    two rotated components, and one gather that puts every channel in its place (channels
    outside every pair keep ``μ``). A decode step asks for one position per layer, where the
    set-up (dtype conversion, the frequency layout check, the channel map) costs more than
    the rotation.
    """

    def __init__(self, rm_mean: Array, freq: Array, pairs: Array):
        xp = _compat.namespace(rm_mean)
        dev = _compat.device(rm_mean)
        self.xp = xp
        mu = xp.astype(rm_mean, xp.float32)
        self.mu = mu[:, :, None, :]  # (b, h, 1, d)
        d = int(mu.shape[-1])
        n_j = int(pairs.shape[0])
        top = xp.max(freq, axis=(0, 1))  # (J,): the layer's frequencies where heads share them
        self.shared = bool(xp.all((freq == 0.0) | (freq == top)))
        self.freq = top if self.shared else freq
        self.turn = (freq != 0.0)[:, :, None, :] if self.shared else None
        self.pair_a, self.pair_b = pairs[:, 0], pairs[:, 1]
        self.ma = xp.take(mu, self.pair_a, axis=2)[:, :, None, :]
        self.mb = xp.take(mu, self.pair_b, axis=2)[:, :, None, :]
        # output channel -> index into concat(ra, rb, μ): pair j's channels are j and J + j
        hnp = _compat.host_numpy()
        host_pairs = _compat.to_numpy(pairs).astype(hnp.int64)
        where = 2 * n_j + hnp.arange(d, dtype=hnp.int64)
        where[host_pairs[:, 0]] = hnp.arange(n_j)
        where[host_pairs[:, 1]] = n_j + hnp.arange(n_j)
        self.gather = _compat.from_host(xp, where, device=dev)

    def at(self, positions: Array) -> Array:
        """``R_t μ`` at ``positions`` (n,): (b, h, n, d) float32."""
        xp = self.xp
        c, s = _phases(xp, self.freq, positions)  # (n, J) shared, else (b, h, n, J)
        if self.turn is not None:
            c = xp.where(self.turn, c, xp.ones_like(c))
            s = xp.where(self.turn, s, xp.zeros_like(s))
        ra = self.ma * c - self.mb * s
        rb = self.mb * c + self.ma * s
        n = int(ra.shape[2])
        mu = xp.broadcast_to(self.mu, (*self.mu.shape[:2], n, int(self.mu.shape[3])))
        return xp.take(xp.concat([ra, rb, mu], axis=-1), self.gather, axis=-1)

    def logit_coefficients(self, q: Array) -> Array:
        """The query side of :meth:`logits` for a ``shared`` plan: (b·h·G, 2J + 1) float32.

        Row ``(b, h, g)`` is ``[A_j · turn_j | B_j · turn_j | const]`` with
        ``A_j = q_a μ_a + q_b μ_b``, ``B_j = q_b μ_a − q_a μ_b`` over the pairs ``j`` and
        ``const = q · μ − Σ_j A_j turn_j`` (``turn_j``: the pair turns in this head; a pair at
        frequency 0 holds a plain mean, as do channels outside every pair); so
        ``q · R_t μ = row · [cos ω t | sin ω t | 1]`` (:meth:`phase_rows`).
        """
        xp = self.xp
        b, h, g, _ = (int(s) for s in q.shape)
        qa = xp.take(q, self.pair_a, axis=3)  # (b, h, G, J)
        qb = xp.take(q, self.pair_b, axis=3)
        turn = xp.astype(self.turn, xp.float32)  # (b, h, 1, J)
        coef_a = (qa * self.ma + qb * self.mb) * turn
        coef_b = (qb * self.ma - qa * self.mb) * turn
        const = xp.sum(q * self.mu, axis=-1) - xp.sum(coef_a, axis=-1)  # (b, h, G)
        return xp.reshape(xp.concat([coef_a, coef_b, const[..., None]], axis=-1), (b * h * g, -1))

    def phase_rows(self, start: int, stop: int) -> Array:
        """``[cos ω t | sin ω t | 1]`` for positions ``start .. stop - 1`` of a ``shared`` plan: (n, 2J + 1) float32."""
        xp = self.xp
        pos = xp.arange(start, stop, dtype=xp.float64, device=_compat.device(self.mu))
        c, s = _phases(xp, self.freq, pos)  # (n, J)
        return xp.concat([c, s, xp.ones_like(c[:, :1])], axis=-1)

    def logits(self, q: Array, start: int, stop: int, phases: Array | None = None) -> Array:
        """``q · R_t μ`` for every query and position ``start .. stop - 1`` as (b, h, G, n) float32.

        ``R_t μ`` itself is never formed.

        Parameters
        ----------
        q : array (b, h, G, d) float32
            ``G`` queries per head.
        start, stop : int
            Positions.
        phases : array (stop - start, 2J + 1) float32, optional
            :meth:`phase_rows` of those positions when the caller has them in another form (a
            GPU kernel's); computed here otherwise. Only a ``shared`` plan reads them.

        Notes
        -----
        Pair ``j`` contributes ``q_a m_a + q_b m_b = A_j cos φ + B_j sin φ`` with ``φ = ω_j t``.
        When the heads share the layer's frequencies (``shared``) the phases are one table for
        every head, so the result is one product, :meth:`logit_coefficients` (b·h·G, 2J + 1)
        times :meth:`phase_rows` (n, 2J + 1) transposed: memory O((b·h·G + J) · n) instead of
        the O(b·h·n·d) of :meth:`at`. Heads with their own frequencies go through :meth:`at`.
        """
        xp = self.xp
        if not self.shared:
            pos = xp.arange(start, stop, dtype=xp.float64, device=_compat.device(self.mu))
            return xp.matmul(q, xp.matrix_transpose(self.at(pos)))
        b, h, g, _ = (int(s) for s in q.shape)
        if phases is None:
            phases = self.phase_rows(start, stop)
        out = xp.matmul(self.logit_coefficients(q), xp.matrix_transpose(phases))
        return xp.reshape(out, (b, h, g, stop - start))


def rotary_mean_at(rm_mean: Array, freq: Array, pairs: Array, positions: Array) -> Array:
    """``R_t μ`` at ``positions``: shape (batch, heads, n, d), float32.

    Parameters
    ----------
    rm_mean : array (batch, heads, d)
        ``μ`` (:attr:`RotaryMean.mean`), any float dtype.
    freq : array (batch, heads, d // 2)
        :attr:`RotaryMean.freq`.
    pairs : array (d // 2, 2) int32
        :attr:`RotaryMean.pairs`.
    positions : array (n,)
        Integer or float positions.

    Notes
    -----
    One call of :class:`RotaryMeanPlan`; a caller asking again for the same layer keeps the plan.
    """
    return RotaryMeanPlan(rm_mean, freq, pairs).at(positions)
