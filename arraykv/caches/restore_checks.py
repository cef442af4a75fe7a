"""Room left by a restored layer: refusing saved state that would make every later call fail.

:mod:`arraykv.caches.layout` checks each saved array on its own (dtypes, shapes, indices,
finite values inside their ranges). That is not enough for the float16 parts of a compressed
cache: a mean, a window token or a basis each inside its range can still leave no room for
the arithmetic the cache does with them and the *next* token. Such a layer loads, and then
every call that stores a token refuses it ("overflow float16"), so the cache can never be
used. The functions here bound, from the stored arrays and the codec's fixed arrays, the
largest float16 number that arithmetic can produce for a new token of ordinary magnitude,
and raise ``ValueError`` naming the array when it would pass :data:`HALF_MAX`. The caches
call them from their ``_restore_layer`` (:mod:`arraykv.caches.snapshots`), so every load path
(:func:`arraykv.load`, :meth:`~arraykv.caches.LayeredCache.restore`, a prefix store's entry)
runs them.

A token of ordinary magnitude
    A key or value whose Euclidean norm is at most ``R``, the largest norm of the tokens the
    layer holds that it will encode later (its window after the sinks, and its rollback
    copies, which a truncation puts back into the window), and at least ``sqrt(head_dim)``
    (unit RMS per channel) so that a layer of tiny tokens still leaves room for ordinary ones.
    So a window token is checked by the same bound as a new token: the window is encoded
    once it spills.

Polar codes (``pq``/``pqo``/``tq``, and the ``pq`` storages of ``window``)
    A key ``x`` at position ``p`` is encoded as ``kc = s ⊙ (x − m_p)`` (channel weights ``s``,
    the key mean ``m_p``, turning with ``p`` in channel pairs for a rotary mean), and
    TurboQuant stores the length ``‖kc‖ / ⟨y, ŷ⟩`` (``y`` the rotated unit vector, ``ŷ`` its
    centroids; the ``"fit"`` length ``‖kc‖ ⟨y, ŷ⟩ / ‖ŷ‖²`` is no larger) in float16. For a
    scalar quantizer with centroid ``c(t)``, ``t · c(t) >= ρ t²`` with ``ρ = min(c_top,
    min_i c_i / t_{i+1})`` over the positive cells (centroid ``c_i``, upper threshold
    ``t_{i+1}``; the top cell ends at 1), so ``⟨y, ŷ⟩ >= ρ`` for every unit ``y`` and the length
    is at most ``‖kc‖ / ρ``. With ``‖kc‖ <= ‖s ⊙ m_p‖ + max(s) · R`` (``‖s ⊙ R_p μ‖`` at most
    ``sqrt(Σ_pairs max(s_a, s_b)² (μ_a² + μ_b²))`` for a rotating mean) the layer keeps room
    when ``(max_p ‖s ⊙ m_p‖ + max(s) R) / ρ <= 65504``; values likewise with ``s = 1``. The
    outlier channels hold ``|kc_c| <= ‖kc‖``, below that bound. A ``tq`` key's residual
    ``r = kc − k̂c`` has ``‖r‖ <= ‖kc‖ (1 + G)`` with ``G = sqrt(d) c_top / ρ`` (``‖ŷ‖ <= sqrt(d)
    c_top``), so the factor is ``max(1/ρ, 1 + G)`` there. A layer not calibrated yet will be
    calibrated on its window and the new tokens: its mean is an average of tokens of norm at
    most ``R`` and its weights at most :data:`~arraykv.caches.polar_calibration.KEY_SCALE_RANGE`
    's top, so ``‖kc‖ <= 2 R · 16`` (values ``2 R``).

    A layer whose callers use float16 gets its keys back as ``k̂c / s + m_p`` in
    that dtype: ``‖k̂c‖ <= G ‖kc‖``, so ``G (max ‖s ⊙ m_p‖ + max(s) R) / min(s) + max |m_p|``
    must stay below 65504 too (values: ``G (‖v_mean‖ + R) + max |v_mean|``). The stored ``tq``
    residual lengths must be lengths a residual of the stored code can have:
    ``‖r‖ <= ‖k̂c‖ + ‖kc‖ <= 2 n sqrt(d) c_top`` for an unbiased length ``n``, ``‖r‖ <= ‖kc‖ <=
    n d c_top² / ρ`` for a fitted one (plus the float16 rounding of ``n``).

Low-rank coefficients (``lowrank``)
    A basis must be orthonormal (``|BᵀB − I| <=`` :data:`ORTHONORMAL_TOL`): the codec is a
    projection, and the bounds below need columns of unit length. A token ``x`` is stored as
    ``c_i = b_iᵀ (x − m)`` in the coefficient dtype; ``|c_i| <= |b_iᵀ m| + ‖b_i‖ R`` must fit it
    (float16: 65504; float32 coefficients: the layout bound 2³²). Decoded, ``x̂ = B c + m``;
    in a float16 layer ``max |m| + σ² (‖m‖ + R)`` (``σ`` the largest column norm, a bound of
    ``‖B‖``) must stay below 65504. A layer not fitted yet will fit a mean of its tokens
    and an orthonormal basis: ``|c_i| <= 2 R``.

Integer groups (``int2``/``int4``/``int8``)
    Exact tokens (the keys waiting for their group, a value window, the rollback copies a
    truncation puts back) are quantized later with ordinary tokens, in the layer's units
    ``2**exp``: a group whose values lie in ``[-M, M]`` (``M`` the largest exact magnitude; a
    new token beyond 65504 in those units is refused by the store itself, and an ordinary one is
    of the layer's magnitude, which the units bring near 1) gets the offset ``min``, so float16
    parameters need ``M <= 65504``; its reconstruction ``offset + scale · code`` exceeds the
    group's largest value by at most three float16 roundings (``2**-11`` each of ``|min|``,
    ``max − min``), so a float16 layer needs ``M (1 + 3 · 2**-11) 2**exp <= 65504``.

Product quantization (``vq``)
    A layer of float16 callers returns centroids as its keys and values; any centroid can be
    the nearest to some token, so every centroid must be a float16 number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import _compat
from .._types import Array, Namespace
from ..quant.codebooks import Codebook
from .layout import MAX_MAGNITUDE
from .polar_calibration import KEY_SCALE_RANGE

__all__ = [
    "HALF_MAX",
    "ORTHONORMAL_TOL",
    "codebook_factors",
    "ordinary_norm",
    "check_polar_room",
    "check_encoded_storage_room",
    "check_qjl_lengths",
    "check_orthonormal",
    "check_lowrank_room",
    "check_int_room",
    "check_centroids",
]

#: The largest finite float16 number.
HALF_MAX = 65504.0
#: Largest ``|BᵀB − I|`` entry of a stored basis (a float32 SVD basis of head_dim 4096 is
#: orthonormal to about 1e-5; a basis off by more is not what the cache fitted or was given).
ORTHONORMAL_TOL = 1e-3
#: Relative rounding of a float16 number (half an ulp at the top of a binade, and some).
_HALF_ROUNDING = 2.0**-10


def codebook_factors(codebook: Codebook, dim: int) -> tuple[float, float, float]:
    """``(ρ, c_top, G)`` of a symmetric scalar codebook (see the module docstring).

    ``ρ``: the smallest ``⟨y, ŷ⟩`` over unit vectors ``y`` (a lower bound); ``c_top``: the
    largest centroid; ``G = sqrt(dim) · c_top / ρ``: a bound of ``‖ŷ‖ / ⟨y, ŷ⟩``.
    """
    c = [float(x) for x in _compat.to_numpy(codebook.centroids).tolist()]
    t = [float(x) for x in _compat.to_numpy(codebook.thresholds).tolist()]
    top = max(abs(x) for x in c)
    rho = top
    edges = sorted(x for x in t if x > 0.0) + [1.0]
    for ci, hi in zip(sorted(x for x in c if x > 0.0), edges):
        rho = min(rho, ci / hi)
    return rho, top, math.sqrt(dim) * top / rho


def ordinary_norm(xp: Namespace, head_dim: int, blocks: Sequence[Array]) -> Array:
    """``R`` per (batch, head), float32 (b, h): the largest norm of the tokens in ``blocks``
    (each (b, h, n, d)), at least ``sqrt(head_dim)``."""
    floor = math.sqrt(head_dim)
    out = None
    for blk in blocks:
        if blk is None or not int(blk.shape[2]):
            continue
        x = xp.astype(blk, xp.float32)
        n = xp.max(xp.sqrt(xp.sum(x * x, axis=-1)), axis=-1)
        out = n if out is None else xp.maximum(out, n)
    if out is None:
        first = next(b for b in blocks if b is not None)
        return xp.full(tuple(first.shape[:2]), floor, dtype=xp.float32, device=_compat.device(first))
    return xp.maximum(out, floor)


def _floor(xp: Namespace, head_dim: int, blocks: dict[str, Array]) -> Array:
    """``sqrt(head_dim)`` per (batch, head) of the blocks, float32 (b, h)."""
    return ordinary_norm(xp, head_dim, [blk[:, :, :0, :] for blk in blocks.values()])


def _largest(xp: Namespace, a: Array) -> float:
    return float(xp.max(a)) if math.prod(int(s) for s in a.shape) else 0.0


def _mean_reach(xp: Namespace, mean: Array, scale: Array, freq: Array | None, pairs: Array | None) -> Array:
    """``max_p ‖s ⊙ m_p‖`` per (b, h): the weighted key mean at its largest over positions."""
    m = xp.astype(mean, xp.float32)
    s = xp.astype(scale, xp.float32)
    if freq is None or pairs is None:
        sm = s * m
        return xp.sqrt(xp.sum(sm * sm, axis=-1))
    a, b = pairs[:, 0], pairs[:, 1]
    ma, mb = xp.take(m, a, axis=-1), xp.take(m, b, axis=-1)
    sa, sb = xp.take(s, a, axis=-1), xp.take(s, b, axis=-1)
    w = xp.maximum(sa, sb)
    return xp.sqrt(xp.sum(w * w * (ma * ma + mb * mb), axis=-1))


def _refuse(names: str, what: str, reach: float) -> None:
    raise ValueError(
        f"stored {names} leave no float16 room: {what} reaches {reach:.6g}, more than {HALF_MAX:g} "
        f"(the state cannot take another token; a cache never writes this)"
    )


def check_polar_room(
    xp: Namespace,
    *,
    head_dim: int,
    calib: object | None,
    k_blocks: dict[str, Array],
    v_blocks: dict[str, Array],
    k_codebook: Codebook,
    v_codebook: Codebook,
    qjl: bool,
    half_output: bool,
) -> None:
    """Refuse a polar layer (``ValueError`` naming the array) whose next key or value, or a
    token of its window, would encode to a float16 length beyond 65504 (module docstring).

    Parameters
    ----------
    calib : PolarCalibration or None
        The layer's calibration (``k_mean``, ``v_mean``, ``k_scale`` float16 (b, h, d), and
        ``k_mean_freq``/``k_mean_pairs`` for a rotating mean); None before calibration.
    k_blocks, v_blocks : dict of str to array
        The tokens the layer will encode later by their saved names (``k_window`` after the
        sinks, ``k_rollback``, ...), each (b, h, n, d) float16.
    k_codebook, v_codebook : Codebook
        The layer's codebooks (``head_dim`` coordinates).
    qjl : bool
        Keys also carry a QJL residual sketch (``tq``).
    half_output : bool
        The layer's callers use float16: decoded keys and values must fit it.
    """
    rho_k, _, g_k = codebook_factors(k_codebook, head_dim)
    rho_v, _, g_v = codebook_factors(v_codebook, head_dim)
    factor_k = max(1.0 / rho_k, 1.0 + g_k) if qjl else 1.0 / rho_k
    factor_v = 1.0 / rho_v
    for side, blocks, factor, g in (("k", k_blocks, factor_k, g_k), ("v", v_blocks, factor_v, g_v)):
        floor = _floor(xp, head_dim, blocks)
        candidates: list[tuple[str | None, Array | None]] = [(None, None), *blocks.items()]
        if calib is None:  # a calibration to come: a mean within R, key weights up to 16
            weight = KEY_SCALE_RANGE[1] if side == "k" else 1.0
            for name, blk in candidates:
                r = floor if blk is None else ordinary_norm(xp, head_dim, [blk])
                reach = _largest(xp, 2.0 * weight * r) * factor
                if reach > HALF_MAX:
                    _refuse(f"'{name or side + '_window'}'", "the encoded length of its tokens once calibrated", reach)
            continue
        mean = getattr(calib, f"{side}_mean")
        if side == "k":
            scale = calib.k_scale  # type: ignore[attr-defined]
            reach_m = _mean_reach(xp, mean, scale, calib.k_mean_freq, calib.k_mean_pairs)  # type: ignore[attr-defined]
            sf = xp.astype(scale, xp.float32)
            s_max, s_min = xp.max(sf, axis=-1), xp.min(sf, axis=-1)
            names = "'k_mean' and 'k_scale'"
        else:
            mf = xp.astype(mean, xp.float32)
            reach_m = xp.sqrt(xp.sum(mf * mf, axis=-1))
            s_max = s_min = xp.ones_like(reach_m)
            names = "'v_mean'"
        peak = xp.max(xp.abs(xp.astype(mean, xp.float32)), axis=-1)  # |m_p|_inf <= |μ| per pair: a bound
        if side == "k" and calib.k_mean_freq is not None:  # type: ignore[attr-defined]
            mf = xp.astype(mean, xp.float32)
            peak = xp.sqrt(xp.max(mf * mf, axis=-1) * 2.0)
        for name, blk in candidates:
            r = floor if blk is None else ordinary_norm(xp, head_dim, [blk])
            kc = reach_m + s_max * r
            reach = _largest(xp, kc) * factor
            what = "a new token of norm up to R" if blk is None else f"a token of '{name}'"
            label = names if blk is None else f"'{name}' (with {names})"
            if reach > HALF_MAX:
                _refuse(label, f"the encoded length of {what}", reach)
            if half_output:
                out = _largest(xp, g * kc / s_min + peak)
                if out > HALF_MAX:
                    _refuse(label, f"the decoded {'key' if side == 'k' else 'value'} of {what}", out)


def check_encoded_storage_room(
    xp: Namespace, *, head_dim: int, calib: object | None, fixed: object, dtype: str
) -> None:
    """:func:`check_polar_room` of a layer that encodes every token as it arrives (the ``pq``
    storages of ``window``: no window waits to be encoded, so ``R = sqrt(head_dim)``).

    ``fixed`` is the cache's :class:`~arraykv.caches.polar_codec.PolarFixed` (codebooks) and
    ``dtype`` the name of the callers' dtype.
    """
    if calib is None:
        return
    mean = calib.k_mean  # type: ignore[attr-defined]
    none = xp.zeros(tuple(mean.shape[:2]) + (0, head_dim), dtype=xp.float32, device=_compat.device(mean))
    check_polar_room(
        xp,
        head_dim=head_dim,
        calib=calib,
        k_blocks={"k_tail": none},
        v_blocks={"v_tail": none},
        k_codebook=fixed.k_codebook,  # type: ignore[attr-defined]
        v_codebook=fixed.v_codebook,  # type: ignore[attr-defined]
        qjl=False,
        half_output=dtype == "float16",
    )


def check_qjl_lengths(
    xp: Namespace, *, k_norms: Array, k_qjl_norms: Array, k_codebook: Codebook, head_dim: int, unbiased: bool
) -> None:
    """Refuse stored ``tq`` residual lengths no residual of the stored codes can have (module docstring)."""
    if not math.prod(int(s) for s in k_norms.shape):
        return
    rho, top, _ = codebook_factors(k_codebook, head_dim)
    bound = 2.0 * math.sqrt(head_dim) * top if unbiased else head_dim * top * top / rho
    n = xp.astype(k_norms, xp.float32)
    r = xp.astype(k_qjl_norms, xp.float32)
    limit = xp.abs(n) * (bound * (1.0 + _HALF_ROUNDING)) + bound * 2.0**-24
    if bool(xp.any(r < 0.0)) or bool(xp.any(r > limit)):
        raise ValueError(
            "stored 'k_qjl_norms' hold residual lengths that the stored 'k_norms' cannot have "
            f"(a residual length is >= 0 and at most {bound:.4g} times its key's length)"
        )


def check_orthonormal(xp: Namespace, name: str, basis: Array) -> None:
    """Refuse a basis (h, d, r) whose columns are not orthonormal within :data:`ORTHONORMAL_TOL`."""
    b = xp.astype(basis, xp.float32)
    gram = xp.matmul(xp.matrix_transpose(b), b)
    r = int(b.shape[-1])
    eye = xp.eye(r, dtype=xp.float32, device=_compat.device(b))
    off = _largest(xp, xp.abs(gram - eye))
    if not off <= ORTHONORMAL_TOL:
        raise ValueError(
            f"stored {name!r} is not orthonormal: |BᵀB − I| reaches {off:.3g}, more than {ORTHONORMAL_TOL:g}"
        )


def check_lowrank_room(
    xp: Namespace,
    *,
    head_dim: int,
    calib: dict[str, Array] | None,
    blocks: dict[str, dict[str, Array]],
    coeff_half: bool,
    half_output: bool,
) -> None:
    """Refuse a ``lowrank`` layer whose bases are not orthonormal, or whose next token (or a
    window token) would get a coefficient or decoded value beyond float16 (module docstring).

    Parameters
    ----------
    calib : dict or None
        ``k_basis``, ``v_basis`` float32 (h, d, r); ``k_mean``, ``v_mean`` float32 (h, d);
        None before the layer is fitted.
    blocks : dict
        ``{"k": {name: (b, h, n, d)}, "v": {...}}``: the tokens the layer will encode later.
    coeff_half : bool
        Coefficients are stored in float16 (else float32, bounded by the layout's 2³²).
    half_output : bool
        The layer's callers use float16: decoded keys and values must fit it.
    """
    cap = HALF_MAX if coeff_half else MAX_MAGNITUDE
    for side in ("k", "v"):
        named = blocks[side]
        floor = _floor(xp, head_dim, named)
        if calib is None:
            for block_name, block in named.items():
                reach = 2.0 * _largest(xp, ordinary_norm(xp, head_dim, [block]))
                if reach > cap:
                    _refuse(f"'{block_name}'", "a coefficient of its tokens", reach)
            continue
        basis = calib[f"{side}_basis"]
        check_orthonormal(xp, f"{side}_basis", basis)
        b = xp.astype(basis, xp.float32)  # (h, d, r)
        m = xp.astype(calib[f"{side}_mean"], xp.float32)  # (h, d)
        along = xp.abs(xp.matmul(m[:, None, :], b)[:, 0, :])  # (h, r): |b_iᵀ m|
        col = xp.sqrt(xp.sum(b * b, axis=1))  # (h, r): ‖b_i‖
        sigma2 = xp.max(col, axis=-1) ** 2  # (h,)
        m_norm = xp.sqrt(xp.sum(m * m, axis=-1))  # (h,)
        peak = xp.max(xp.abs(m), axis=-1)  # (h,)
        names = f"'{side}_mean' and '{side}_basis'"
        candidates: list[tuple[str | None, Array | None]] = [(None, None), *named.items()]
        for name, blk in candidates:
            r = floor if blk is None else ordinary_norm(xp, head_dim, [blk])  # (batch, h)
            r_h = xp.max(r, axis=0)  # (h,)
            coef = _largest(xp, along + col * r_h[:, None])
            what = "a new token of norm up to R" if blk is None else f"a token of '{name}'"
            label = names if blk is None else f"'{name}' (with {names})"
            if coef > cap:
                _refuse(label, f"a coefficient of {what}", coef)
            if half_output:
                out = _largest(xp, peak + sigma2 * (m_norm + r_h))
                if out > HALF_MAX:
                    _refuse(label, f"the decoded value of {what}", out)


def check_int_room(
    xp: Namespace,
    *,
    exact: dict[str, dict[str, Array]],
    exps: tuple[int | None, ...],
    half_params: bool,
    half_output: bool,
) -> None:
    """Refuse an integer-cache layer whose exact tokens leave no float16 room for the group they
    will be quantized in (module docstring, integer caches).

    Parameters
    ----------
    exact : dict
        ``{"k": {name: (b, h, n, d)}, "v": {...}}``: the exact tokens, in the layer's units
        (``k_residual``, ``v_window`` and the rollback copies a truncation puts back).
    exps : tuple
        The layer's exponents (keys, values); None where not fixed yet (0 is used).
    half_params : bool
        Scales and offsets are float16.
    half_output : bool
        The layer's callers use float16.
    """
    for named, exp in zip(exact.values(), exps):
        unit = 2.0 ** (exp or 0)
        for name, blk in named.items():
            m = _largest(xp, xp.abs(xp.astype(blk, xp.float32)))
            if half_params and m > HALF_MAX:
                _refuse(f"'{name}'", "the float16 offset of the group holding it", m)
            reach = m * (1.0 + 3.0 * 2.0**-11) * unit
            if half_output and reach > HALF_MAX:
                _refuse(f"'{name}'", "the float16 key or value decoded from the group holding it", reach)


def check_centroids(xp: Namespace, centroids: dict[str, Array]) -> None:
    """Refuse centroids (any shape, by name) beyond float16, for a layer of float16 callers."""
    for name, c in centroids.items():
        top = _largest(xp, xp.abs(xp.astype(c, xp.float32)))
        if top > HALF_MAX:
            raise ValueError(
                f"stored {name!r} holds a centroid of magnitude {top:.6g}, beyond the float16 keys and "
                f"values this layer returns"
            )
