"""The ``lowrank`` cache: keys and values as coefficients on a per-(layer, KV head) PCA basis.

``x ≈ mean + basis @ coef`` (:mod:`arraykv.quant.lowrank`); the fit, the sinks and the window
are those of every fitted cache (:mod:`arraykv.caches.fitted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat, ops
from .._types import Array, DType, Namespace
from .._validation import check_bool, check_int, dtype_name
from ..compressor import KVCacheCompressor, LowRank, samples_by_head
from ..quant.lowrank import LowRankBasis, LowRankLayerCoefficients, check_rank_energy, fit_basis, row_products
from ..quant.polar import half_dtype
from ..storage import TokenBuffers
from .fitted import DEFAULT_SINKS, DEFAULT_WINDOW, FittedCache, FittedLayer, _f32
from .layout import Layout, Spec, bounded
from .restore_checks import check_lowrank_room
from .rollback import DEFAULT_ROLLBACK_TOKENS

__all__ = ["LowRankCache"]

#: One layer's given bases: a fitted compressor, or a ``(k_basis, v_basis)`` pair.
LowRankItem = KVCacheCompressor | tuple[LowRankBasis, LowRankBasis]

_COEFF_DTYPES = ("float16", "float32")


class LowRankCache(FittedCache):
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
    rollback_tokens : int, default 16
        Tokens a layer can always be truncated by once fitted (float16 copies of the last
        ``rollback_tokens`` encoded tokens; see :meth:`~arraykv.caches.LayeredCache.truncate`).
    decode_path : {"auto", "fused", "dequantized"}, default "auto"
        ``"auto"`` and ``"fused"``: ``decode`` attends in coefficient space and returns
        :class:`~arraykv.Fused` (:func:`arraykv.ops.lowrank_decode_attention`: a Numba kernel that
        reads the coefficients in place on NumPy, array-API matrix products on every other
        namespace); ``"dequantized"`` reconstructs the layer and returns :class:`~arraykv.Dequantized`.

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

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        rank: int | None = None,
        energy: float | None = None,
        center: bool = True,
        coeff_dtype: str = "float16",
        calibration: LowRankItem | Sequence[LowRankItem | None] | None = None,
        min_calibration: int | None = None,
        residual_window: int = DEFAULT_WINDOW,
        sink_tokens: int = DEFAULT_SINKS,
        rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
        decode_path: str = "auto",
        check_finite: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        d = check_int("head_dim", head_dim, low=1)
        if rank is None and energy is None:
            rank = max(1, d // 2)
        self.rank, self.energy = check_rank_energy(rank, energy, d)
        self.center = check_bool("center", center)
        if not isinstance(coeff_dtype, str) or coeff_dtype not in _COEFF_DTYPES:
            raise ValueError(f"coeff_dtype must be one of {', '.join(_COEFF_DTYPES)}, received {coeff_dtype!r}")
        self.coeff_dtype = coeff_dtype
        self.min_calibration = d if min_calibration is None else check_int("min_calibration", min_calibration, low=2)
        super().__init__(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            calibration=calibration,
            residual_window=residual_window,
            sink_tokens=sink_tokens,
            rollback_tokens=rollback_tokens,
            decode_path=decode_path,
            check_finite=check_finite,
            max_tokens=max_tokens,
        )

    def _extra_config(self) -> dict[str, Any]:
        return super()._extra_config() | {
            "rank": self.rank,
            "energy": self.energy,
            "center": self.center,
            "coeff_dtype": self.coeff_dtype,
        }

    def _item_help(self) -> str:
        return "a fitted KVCacheCompressor(LowRank(...)) or a pair (k_basis, v_basis) of LowRankBasis"

    def _convert(self, item: Any, where: str = "calibration") -> dict[str, Array]:
        out = {}
        for name, b in zip(("k", "v"), self._pair(item, LowRank, where)):
            if not isinstance(b, LowRankBasis):
                raise TypeError(f"{where} must hold LowRankBasis, received {type(b).__name__}")
            if b.basis.ndim != 3:
                raise ValueError(
                    f"{where}: the {name} basis must be (heads, head_dim, rank), "
                    f"received shape {tuple(int(s) for s in b.basis.shape)}"
                )
            self._check_heads(where, b.basis, f"the {name} basis")
            xp = _compat.namespace(b.basis)
            out[f"{name}_basis"] = xp.asarray(_f32(xp, b.basis), copy=True)
            if b.mean is None:
                out[f"{name}_mean"] = xp.zeros(
                    (self.num_kv_heads, self.head_dim), dtype=xp.float32, device=_compat.device(b.basis)
                )
            else:
                self._check_heads(where, b.mean, f"the {name} mean")
                out[f"{name}_mean"] = xp.asarray(_f32(xp, b.mean), copy=True)
        return out

    def _fit_layout(self, xp: Namespace) -> Layout:
        """``k_basis`` (h, d, r_k), ``k_mean`` (h, d), likewise for values: float32, bounded,
        ``1 <= r <= head_dim``."""
        h, d = self.num_kv_heads, self.head_dim
        arrays: dict[str, Spec] = {}
        for name in ("k", "v"):
            arrays[f"{name}_basis"] = bounded(xp.float32, (h, d, f"{name}_rank"), required=False)
            arrays[f"{name}_mean"] = bounded(xp.float32, (h, d), required=False)

        def ranks(sizes: dict[str, int], held: frozenset[str]) -> str | None:
            bad = [sizes[n] for n in ("k_rank", "v_rank") if n in sizes and not 1 <= sizes[n] <= d]
            return f"stored bases must keep 1 to head_dim={d} directions, received {bad[0]}" if bad else None

        return Layout(arrays=arrays, rules=(ranks,))

    def _token_specs(self, xp: Namespace, batch: int) -> dict[str, Spec]:
        tok = (batch, self.num_kv_heads, "codes")
        return {f"{n}_coef": bounded(self._cdt(xp), tok + (f"{n}_rank",), required=False) for n in ("k", "v")}

    def _cdt(self, xp: Namespace) -> DType:
        return xp.float32 if self.coeff_dtype == "float32" else half_dtype(xp)

    def _fit(self, xp: Namespace, k: Array, v: Array) -> dict[str, Array]:
        out = {}
        for name, x in (("k", k), ("v", v)):
            b = fit_basis(samples_by_head(xp, x), rank=self.rank, energy=self.energy, center=self.center)
            out[f"{name}_basis"] = b.basis
            out[f"{name}_mean"] = (
                b.mean
                if b.mean is not None
                else xp.zeros((self.num_kv_heads, self.head_dim), dtype=xp.float32, device=_compat.device(x))
            )
        return out

    def _encode(self, xp: Namespace, calib: dict[str, Array], k: Array, v: Array) -> dict[str, Array]:
        cdt = self._cdt(xp)
        out = {}
        for name, x in (("k", k), ("v", v)):
            c = row_products(x - calib[f"{name}_mean"][:, None, :], calib[f"{name}_basis"])  # per token, one order
            out[f"{name}_coef"] = c if c.dtype == cdt else xp.astype(c, cdt)
        return out

    def _check_room(self, st: FittedLayer) -> None:
        kw, vw = st.exact.recent()
        check_lowrank_room(
            st.xp,
            head_dim=self.head_dim,
            calib=st.calib,
            blocks={
                "k": {"k_window": kw, "k_rollback": st.rollback.k},
                "v": {"v_window": vw, "v_rollback": st.rollback.v},
            },
            coeff_half=self._cdt(st.xp) != st.xp.float32,
            half_output=dtype_name(st.dtype) == "float16",
        )

    def _fused_auto(self, xp: Namespace) -> bool:
        return True  # matrix products in coefficient space: cheaper than reconstructing, everywhere

    def _attend(self, st: FittedLayer, q: Array, scale: float) -> Array:
        buf, calib = st.codes, st.calib
        ke, ve = self._extras(st)
        if calib is None or not buf.length:
            empty = LowRankLayerCoefficients(ke[:, :, :0, :], None, None, ve[:, :, :0, :], None, None)
            return ops.lowrank_decode_attention(q, empty, ke, ve, softmax_scale=scale)
        coefficients = LowRankLayerCoefficients(
            k_coef=buf.view("k_coef"),
            k_basis=calib["k_basis"],
            k_mean=calib["k_mean"],
            v_coef=buf.view("v_coef"),
            v_basis=calib["v_basis"],
            v_mean=calib["v_mean"],
        )
        return ops.lowrank_decode_attention(q, coefficients, ke, ve, softmax_scale=scale)

    def _decode_tokens(
        self, xp: Namespace, calib: dict[str, Array], buf: TokenBuffers, start: int = 0
    ) -> tuple[Array, Array]:
        out = []
        for name in ("k", "v"):
            c = _f32(xp, buf.view(f"{name}_coef")[:, :, start:, :])
            out.append(xp.matmul(c, xp.matrix_transpose(calib[f"{name}_basis"])) + calib[f"{name}_mean"][:, None, :])
        return out[0], out[1]
