"""Whole-tensor KV compression: low rank, product quantization, and low rank + integers.

:class:`KVCacheCompressor` compresses the keys and values of a layer at once (for storage,
transfer or offloading), and bridges to the paged and MLA caches. Methods are small frozen
dataclasses: :class:`LowRank`, :class:`VectorQuantization`, :class:`Hybrid`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias, TypedDict, cast

from .. import _compat, ops
from .._types import Array, Namespace
from .._validation import array_namespace, check_finite, dtype_name, is_floating
from ..quant.intq import IntQuantized, dequantize_groups, quantize_groups
from ..quant.lowrank import LowRankBasis, fit_basis, project
from ..quant.outliers import SparseOutliers, scatter_outliers
from ..quant.vq import VQCodebook, VQCodes, train_vq, vq_decode, vq_encode
from .methods import CompressedKV, CompressedTensor, Hybrid, LowRank, VectorQuantization, _check_quant_bits

if TYPE_CHECKING:
    from ..storage.mla import MlaCache
    from ..storage.paged import PagedKVCache

__all__ = [
    "KVCacheCompressor",
    "samples_by_head",
    "compress_paged_cache",
    "decompress_to_paged_cache",
    "compress_mla_cache",
    "decompress_to_mla_cache",
]

#: A fitted model: the basis of a low-rank or hybrid method, the codebooks of VQ.
_Model: TypeAlias = "LowRankBasis | VQCodebook"


class _Fit(TypedDict):
    heads: int
    head_dim: int
    v_head_dim: int
    k: _Model
    v: _Model


class KVCacheCompressor:
    """Compress whole K/V tensors with a low-rank, product-quantization or hybrid method.

    Parameters
    ----------
    method : LowRank, VectorQuantization or Hybrid
        How to compress (see each method's parameters).
    quant_bits : {4, 8}, optional
        Integer width of the hybrid coefficients. Defaults to the method's ``quant_bits``
        (Hybrid) or 8; giving a value that contradicts a Hybrid method is an error.

    Attributes
    ----------
    method, quant_bits
    fitted : bool
        True after :meth:`fit`: compression then reuses the fitted bases/codebooks instead of
        fitting on every call.

    Examples
    --------
    >>> import numpy as np, arraykv
    >>> k = np.random.default_rng(0).standard_normal((1, 2, 64, 16)).astype(np.float32)
    >>> comp = arraykv.KVCacheCompressor(arraykv.LowRank(rank=16))
    >>> c = comp.compress_kv(k, k)
    >>> k2, v2 = comp.decompress_kv(c)
    >>> bool(np.allclose(k2, k, atol=1e-4))
    True
    """

    def __init__(self, method: LowRank | VectorQuantization | Hybrid, quant_bits: int | None = None) -> None:
        if not isinstance(method, (LowRank, VectorQuantization, Hybrid)):
            raise TypeError(f"method must be LowRank, VectorQuantization or Hybrid, received {type(method).__name__}")
        if quant_bits is None:
            quant_bits = method.quant_bits if isinstance(method, Hybrid) else 8
        quant_bits = _check_quant_bits(quant_bits)
        if isinstance(method, Hybrid) and method.quant_bits != quant_bits:
            raise ValueError(
                f"quant_bits={quant_bits} contradicts the method's quant_bits={method.quant_bits}; give one"
            )
        self.method = method
        self.quant_bits = quant_bits
        self._fit: _Fit | None = None

    @property
    def kind(self) -> str:
        return {LowRank: "lowrank", VectorQuantization: "pq", Hybrid: "hybrid"}[type(self.method)]

    @property
    def fitted(self) -> bool:
        return self._fit is not None

    def __repr__(self) -> str:
        return f"KVCacheCompressor({self.method!r}, quant_bits={self.quant_bits}, fitted={self.fitted})"

    # -- validation ---------------------------------------------------------------
    def _check_pair(self, k: Array, v: Array, ndim: int) -> Namespace:
        xp = array_namespace(k=k, v=v)
        what = "(batch, heads, seq, head_dim)" if ndim == 4 else "(heads, seq, head_dim)"
        for name, x in (("k", k), ("v", v)):
            if x.ndim != ndim:
                raise ValueError(f"{name} must have {ndim} dimensions {what}, received shape {tuple(x.shape)}")
            if not is_floating(xp, x.dtype):
                raise TypeError(f"{name} must have a floating dtype, received {dtype_name(x.dtype)}")
            if any(int(s) < 1 for s in x.shape):
                raise ValueError(f"{name} must have no empty axis, received shape {tuple(x.shape)}")
        if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
            raise ValueError(
                f"k and v shapes must match (except head_dim, for MLA-style values), received "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != v.dtype:
            raise TypeError(f"k and v must share one dtype, received {dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
        check_finite(xp, k=k, v=v)
        self._check_geometry(
            int(k.shape[-1]),
            int(v.shape[-1]),
            int(k.shape[-3]),
            int(k.shape[-2]) * (int(k.shape[0]) if ndim == 4 else 1),
        )
        return xp

    def _check_geometry(self, dk: int, dv: int, heads: int, samples: int) -> None:
        m = self.method
        for d in (dk, dv):
            if isinstance(m, (LowRank, Hybrid)) and m.rank is not None and m.rank > d:
                raise ValueError(f"rank must be <= head_dim={d}, received {m.rank}")
            if isinstance(m, VectorQuantization) and d % m.sub_dim != 0:
                raise ValueError(f"sub_dim must divide head_dim={d}, received sub_dim={m.sub_dim}")
        if self._fit is not None:
            if (self._fit["heads"], self._fit["head_dim"], self._fit["v_head_dim"]) != (heads, dk, dv):
                raise ValueError(
                    f"the compressor was fitted on {self._fit['heads']} heads of head_dim {self._fit['head_dim']} "
                    f"(values {self._fit['v_head_dim']}), received {heads} heads of head_dim {dk} (values {dv})"
                )
        elif isinstance(m, VectorQuantization) and samples < m.codebook_size:
            raise ValueError(
                f"codebook_size={m.codebook_size} needs at least that many vectors per head to train on, received "
                f"{samples} (batch * seq); call fit() on calibration data first or lower codebook_size"
            )

    # -- fitting ------------------------------------------------------------------
    def fit(self, k: Array, v: Array) -> KVCacheCompressor:
        """Fit the bases (low rank, hybrid) or codebooks (VQ) once, on calibration K/V.

        Parameters
        ----------
        k, v : array, shape (batch, heads, seq, head_dim) or (heads, seq, head_dim)
            Calibration keys and values, floating, finite, of one dtype; ``v`` may have another
            ``head_dim`` (MLA-style values).

        Returns
        -------
        KVCacheCompressor
            ``self``, fitted.
        """
        nd = getattr(k, "ndim", None)
        if nd not in (3, 4):
            raise ValueError(f"k must have 3 or 4 dimensions, received {getattr(k, 'shape', type(k).__name__)}")
        saved, self._fit = self._fit, None
        try:
            xp = self._check_pair(k, v, nd)
        except Exception:
            self._fit = saved
            raise
        if nd == 3:
            k, v = k[None, ...], v[None, ...]
        fit: _Fit = {
            "heads": int(k.shape[1]),
            "head_dim": int(k.shape[3]),
            "v_head_dim": int(v.shape[3]),
            "k": self._fit_one(xp, k),
            "v": self._fit_one(xp, v),
        }
        self._fit = fit
        return self

    def fitted_models(self) -> tuple[_Model, _Model]:
        """``(k_model, v_model)``: the fitted bases (``LowRankBasis``) or codebooks of keys and values.

        Returns
        -------
        tuple
            The keys' and the values' ``LowRankBasis`` (low rank, hybrid) or ``VQCodebook`` (VQ).

        Raises
        ------
        ValueError
            When the compressor is not fitted (call :meth:`fit` first).
        """
        fit = self._fit
        if fit is None:
            raise ValueError("the KVCacheCompressor is not fitted (call fit(k, v) first)")
        return fit["k"], fit["v"]

    def reset_fit(self) -> None:
        """Forget the fitted bases/codebooks (compression fits on every call again)."""
        self._fit = None

    def _fit_one(self, xp: Namespace, x: Array, dense: Array | None = None) -> _Model:
        m = self.method
        if isinstance(m, VectorQuantization):
            return train_vq(
                samples_by_head(xp, x),
                codebook_size=m.codebook_size,
                sub_dim=m.sub_dim,
                max_iter=m.max_iter,
                tol=m.tol,
                seed=m.seed,
                assign=ops.vq_assign,
                update=ops.vq_update,
            )
        src = x if dense is None else dense
        if isinstance(m, LowRank):
            return fit_basis(
                samples_by_head(xp, src), rank=m.rank, energy=m.energy, center=m.center, per_head=m.per_head
            )
        if dense is None and m.outlier_threshold is not None:
            src, _ = ops.split_outliers(x, m.outlier_threshold)
        return fit_basis(samples_by_head(xp, src), rank=m.rank, center=m.center)

    # -- compression --------------------------------------------------------------
    def compress_kv(self, k: Array, v: Array) -> CompressedKV:
        """Compress keys and values of shape (batch, heads, seq, head_dim).

        Parameters
        ----------
        k, v : array, shape (batch, heads, seq, head_dim)
            Keys and values, floating, finite, of one dtype; ``v`` may have another ``head_dim``.

        Returns
        -------
        CompressedKV
            ``layout="bhsd"``.

        Raises
        ------
        ValueError, TypeError
            Mismatched shapes or dtypes, non-finite values, a rank above ``head_dim``, a
            ``sub_dim`` that does not divide ``head_dim``, fewer vectors than
            ``codebook_size`` for an unfitted VQ compressor, a geometry unlike the fitted one.
        """
        xp = self._check_pair(k, v, 4)
        return CompressedKV(
            k=self._compress_one(xp, k, "k"), v=self._compress_one(xp, v, "v"), layout="bhsd", method=self.kind
        )

    def compress_kv_3d(self, k: Array, v: Array) -> CompressedKV:
        """Compress keys and values of shape (heads, seq, head_dim); ``layout="hsd"``.

        Parameters
        ----------
        k, v : array, shape (heads, seq, head_dim)
            Keys and values of one sequence, as :meth:`compress_kv` takes them.

        Returns
        -------
        CompressedKV
            ``layout="hsd"``.
        """
        xp = self._check_pair(k, v, 3)
        return CompressedKV(
            k=self._compress_one(xp, k[None, ...], "k"),
            v=self._compress_one(xp, v[None, ...], "v"),
            layout="hsd",
            method=self.kind,
        )

    def decompress_kv(self, c: CompressedKV) -> tuple[Array, Array]:
        """Reconstruct ``(k, v)`` in the layout, dtype and namespace they were given in.

        Parameters
        ----------
        c : CompressedKV
            From :meth:`compress_kv` or :meth:`compress_kv_3d` of a compressor of the same method.

        Returns
        -------
        k : array
            Keys, ``(batch, heads, seq, head_dim)`` for ``layout="bhsd"``, ``(heads, seq,
            head_dim)`` for ``"hsd"``.
        v : array
            Values, in the same layout.
        """
        if not isinstance(c, CompressedKV):
            raise TypeError(f"c must be a CompressedKV, received {type(c).__name__}")
        k, v = self._decompress_one(c.k), self._decompress_one(c.v)
        if c.layout == "hsd":
            k, v = k[0, ...], v[0, ...]
        return k, v

    def decompress_kv_3d(self, c: CompressedKV) -> tuple[Array, Array]:
        """Reconstruct ``(k, v)`` of shape (heads, seq, head_dim) from a ``"hsd"`` CompressedKV.

        Parameters
        ----------
        c : CompressedKV
            With ``layout="hsd"`` (from :meth:`compress_kv_3d`).

        Returns
        -------
        k : array, shape (heads, seq, head_dim)
            Keys, in the dtype and namespace they were given in.
        v : array, shape (heads, seq, v_head_dim)
            Values, likewise.
        """
        if not isinstance(c, CompressedKV):
            raise TypeError(f"c must be a CompressedKV, received {type(c).__name__}")
        if c.layout != "hsd":
            raise ValueError(f"decompress_kv_3d needs a CompressedKV with layout 'hsd', received {c.layout!r}")
        return self.decompress_kv(c)

    def _model(
        self, xp: Namespace, x: Array, which: Literal["k", "v"], dense: Array | None = None
    ) -> tuple[_Model, bool]:
        if self._fit is not None:
            return self._fit[which], True
        return self._fit_one(xp, x, dense), False

    def _compress_one(self, xp: Namespace, x: Array, which: Literal["k", "v"]) -> CompressedTensor:
        shape = tuple(int(s) for s in x.shape)
        m = self.method
        if isinstance(m, VectorQuantization):
            model, shared = self._model(xp, x, which)
            cb = cast(VQCodebook, model)  # what a VQ method fits
            codes = vq_encode(x, cb, encode=ops.vq_encode)
            parts = {"codes": codes.codes, "centroids": cb.centroids}
            meta = {
                "bits": codes.bits,
                "subspaces": codes.subspaces,
                "iterations": cb.iterations,
                "objective": cb.objective,
            }
            return CompressedTensor("pq", shape, x.dtype, parts, frozenset({"centroids"} if shared else ()), meta)
        if isinstance(m, LowRank):
            model, shared = self._model(xp, x, which)
            basis = cast(LowRankBasis, model)  # what a low-rank method fits
            coeffs = project(x, basis)
            parts = {"coeffs": xp.astype(coeffs, x.dtype) if coeffs.dtype != x.dtype else coeffs, "basis": basis.basis}
            if basis.mean is not None:
                parts["mean"] = basis.mean
            names = frozenset(n for n in ("basis", "mean") if shared and n in parts)
            return CompressedTensor("lowrank", shape, x.dtype, parts, names, {"rank": basis.rank})
        # Hybrid
        if m.outlier_threshold is not None:
            dense, outl = ops.split_outliers(x, m.outlier_threshold)
        else:
            dense = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
            outl = None
        model, shared = self._model(xp, x, which, dense)
        basis = cast(LowRankBasis, model)  # what a hybrid method fits
        coeffs_t = _project_t(xp, dense, basis)  # (b, h, r, s)
        group = m.group_size
        q = quantize_groups(
            coeffs_t, self.quant_bits, group, group_minmax=ops.intq_group_minmax, quantize_pack=ops.intq_quantize_pack
        )
        parts = {"codes": q.codes, "scale": q.scale, "offset": q.offset, "basis": basis.basis}
        if basis.mean is not None:
            parts["mean"] = basis.mean
        if outl is not None:
            parts["outlier_index"] = outl.index
            parts["outlier_value"] = outl.value
        names = frozenset(n for n in ("basis", "mean") if shared and n in parts)
        meta = {
            "rank": basis.rank,
            "bits": self.quant_bits,
            "group_size": group,
            "outliers": 0 if outl is None else outl.count,
        }
        return CompressedTensor("hybrid", shape, x.dtype, parts, names, meta)

    def _decompress_one(self, t: CompressedTensor) -> Array:
        if not isinstance(t, CompressedTensor):
            raise TypeError(f"expected a CompressedTensor, received {type(t).__name__}")
        p = t.parts
        xp = _compat.namespace(*p.values())
        if t.kind == "pq":
            cb = VQCodebook(centroids=p["centroids"])
            return vq_decode(
                VQCodes(codes=p["codes"], bits=t.meta["bits"], subspaces=t.meta["subspaces"]),
                cb,
                dtype=t.dtype,
                decode=ops.vq_decode,
            )
        basis = LowRankBasis(basis=p["basis"], mean=p.get("mean"), variance=None, rank=int(p["basis"].shape[-1]))
        if t.kind == "lowrank":
            coeffs = p["coeffs"]
            coeffs = xp.astype(coeffs, xp.float32) if coeffs.dtype != xp.float32 else coeffs
            out = xp.matmul(coeffs, xp.matrix_transpose(basis.basis))
        elif t.kind == "hybrid":
            q = IntQuantized(
                codes=p["codes"],
                scale=p["scale"],
                offset=p["offset"],
                bits=t.meta["bits"],
                group_size=t.meta["group_size"],
                n=t.shape[2],
            )
            coeffs_t = dequantize_groups(q, dequantize=ops.intq_dequantize)  # (b, h, r, s)
            out = xp.matrix_transpose(xp.matmul(basis.basis, coeffs_t))  # (b, h, s, d)
        else:
            raise ValueError(f"unknown compressed kind {t.kind!r}")
        if basis.mean is not None:
            out = out + basis.mean[:, None, :]
        out = xp.astype(out, t.dtype) if out.dtype != t.dtype else out
        if "outlier_index" in p:
            out = scatter_outliers(out, SparseOutliers(index=p["outlier_index"], value=p["outlier_value"]))
        return out

    # -- bridges ------------------------------------------------------------------
    def compress_paged_cache(self, cache: PagedKVCache, layer: int, seq_id: int) -> CompressedKV:
        """Compress the K/V of one sequence of a :class:`~arraykv.PagedKVCache` layer (``"hsd"``).

        Parameters
        ----------
        cache : PagedKVCache
            The cache holding the sequence.
        layer : int
            Layer index of ``cache``.
        seq_id : int
            A live sequence of ``cache`` holding at least one token in ``layer``.

        Returns
        -------
        CompressedKV
            The sequence's keys and values, ``layout="hsd"``.
        """
        k, v = cache.get_kv(layer, seq_id)
        return self.compress_kv_3d(k, v)

    def decompress_to_paged_cache(self, c: CompressedKV, cache: PagedKVCache, layer: int, seq_id: int) -> None:
        """Decompress ``c`` and append its tokens to ``seq_id`` in ``layer`` of a paged cache.

        Parameters
        ----------
        c : CompressedKV
            Keys and values to restore: ``layout="hsd"``, or ``"bhsd"`` with a batch of one.
        cache : PagedKVCache
            The cache to append to.
        layer : int
            Layer index of ``cache``.
        seq_id : int
            A live sequence of ``cache``; the tokens are appended after the ones it holds.
        """
        k, v = self.decompress_kv(c)
        if c.layout == "bhsd":
            if int(k.shape[0]) != 1:
                raise ValueError(f"a paged sequence takes one batch row, received batch {int(k.shape[0])}")
            k, v = k[0, ...], v[0, ...]
        cache.append(layer, seq_id, k, v)

    def compress_mla_cache(self, cache: MlaCache, layer: int, seq_id: int) -> CompressedKV:
        """Compress the K/V that an :class:`~arraykv.MlaCache` sequence reconstructs (``"hsd"``).

        Parameters
        ----------
        cache : MlaCache
            The cache holding the sequence.
        layer : int
            Layer index of ``cache``.
        seq_id : int
            A live sequence of ``cache`` holding at least one token in ``layer``.

        Returns
        -------
        CompressedKV
            The keys and values the sequence's latents reconstruct, ``layout="hsd"``.
        """
        k, v = cache.get_kv(layer, seq_id)
        return self.compress_kv_3d(k, v)

    def decompress_to_mla_cache(self, c: CompressedKV, cache: MlaCache, layer: int, seq_id: int) -> None:
        """Decompress ``c`` and append its tokens to ``seq_id`` of an MLA cache (re-projected to latents).

        Parameters
        ----------
        c : CompressedKV
            Keys and values to restore: ``layout="hsd"``, or ``"bhsd"`` with a batch of one.
        cache : MlaCache
            The cache to append to; the keys and values are projected to its latents.
        layer : int
            Layer index of ``cache``.
        seq_id : int
            A live sequence of ``cache``; the tokens are appended after the ones it holds.
        """
        k, v = self.decompress_kv(c)
        if c.layout == "bhsd":
            if int(k.shape[0]) != 1:
                raise ValueError(f"an MLA sequence takes one batch row, received batch {int(k.shape[0])}")
            k, v = k[0, ...], v[0, ...]
        cache.append(layer, seq_id, k, v)


def samples_by_head(xp: Namespace, x: Array) -> Array:
    """(batch, heads, seq, d) → (heads, batch · seq, d): every head's vectors, the samples a fit sees."""
    b, h, s, d = (int(t) for t in x.shape)
    return xp.reshape(xp.permute_dims(x, (1, 0, 2, 3)), (h, b * s, d))


def _project_t(xp: Namespace, x32: Array, b: LowRankBasis) -> Array:
    """Coefficients with tokens last: basisᵀ (h, r, d) @ (x - mean)ᵀ (b, h, d, s) → (b, h, r, s)."""
    if b.mean is not None:
        x32 = x32 - b.mean[:, None, :]
    return xp.matmul(xp.matrix_transpose(b.basis), xp.matrix_transpose(x32))


def compress_paged_cache(compressor: KVCacheCompressor, cache: PagedKVCache, layer: int, seq_id: int) -> CompressedKV:
    """Function form of :meth:`KVCacheCompressor.compress_paged_cache`.

    Parameters
    ----------
    compressor : KVCacheCompressor
        The compressor to use (fitted or not).
    cache : PagedKVCache
        The cache holding the sequence.
    layer : int
        Layer index of ``cache``.
    seq_id : int
        A live sequence of ``cache`` holding at least one token in ``layer``.

    Returns
    -------
    CompressedKV
        The sequence's keys and values, ``layout="hsd"``.
    """
    return compressor.compress_paged_cache(cache, layer, seq_id)


def decompress_to_paged_cache(
    compressor: KVCacheCompressor, c: CompressedKV, cache: PagedKVCache, layer: int, seq_id: int
) -> None:
    """Function form of :meth:`KVCacheCompressor.decompress_to_paged_cache`.

    Parameters
    ----------
    compressor : KVCacheCompressor
        The compressor that made ``c`` (its fitted models when it was fitted).
    c : CompressedKV
        Keys and values to restore: ``layout="hsd"``, or ``"bhsd"`` with a batch of one.
    cache : PagedKVCache
        The cache to append to.
    layer : int
        Layer index of ``cache``.
    seq_id : int
        A live sequence of ``cache``; the tokens are appended after the ones it holds.
    """
    compressor.decompress_to_paged_cache(c, cache, layer, seq_id)


def compress_mla_cache(compressor: KVCacheCompressor, cache: MlaCache, layer: int, seq_id: int) -> CompressedKV:
    """Function form of :meth:`KVCacheCompressor.compress_mla_cache`.

    Parameters
    ----------
    compressor : KVCacheCompressor
        The compressor to use (fitted or not).
    cache : MlaCache
        The cache holding the sequence.
    layer : int
        Layer index of ``cache``.
    seq_id : int
        A live sequence of ``cache`` holding at least one token in ``layer``.

    Returns
    -------
    CompressedKV
        The keys and values the sequence's latents reconstruct, ``layout="hsd"``.
    """
    return compressor.compress_mla_cache(cache, layer, seq_id)


def decompress_to_mla_cache(
    compressor: KVCacheCompressor, c: CompressedKV, cache: MlaCache, layer: int, seq_id: int
) -> None:
    """Function form of :meth:`KVCacheCompressor.decompress_to_mla_cache`.

    Parameters
    ----------
    compressor : KVCacheCompressor
        The compressor that made ``c`` (its fitted models when it was fitted).
    c : CompressedKV
        Keys and values to restore: ``layout="hsd"``, or ``"bhsd"`` with a batch of one.
    cache : MlaCache
        The cache to append to; the keys and values are projected to its latents.
    layer : int
        Layer index of ``cache``.
    seq_id : int
        A live sequence of ``cache``; the tokens are appended after the ones it holds.
    """
    compressor.decompress_to_mla_cache(c, cache, layer, seq_id)
