"""The ``vq`` cache: keys and values as product-quantization codes on per-(layer, KV head) codebooks.

Every vector is split into sub-vectors of ``sub_dim`` channels, each stored as the index of its
nearest centroid in a per-(layer, KV head, sub-space) k-means codebook
(:mod:`arraykv.quant.vq`); the fit, the sinks and the window are those of every fitted cache
(:mod:`arraykv.caches.fitted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat, ops
from .._types import Array, DType, Namespace
from .._validation import check_int, dtype_name
from ..attention.reference import attention
from ..compressor import KVCacheCompressor, VectorQuantization, samples_by_head
from ..quant.bitpack import packed_nbytes, unpack_bits_reference
from ..quant.vq import VQCodebook, VQCodes, VQLayerCodes, check_vq_options, code_bits, train_vq, vq_decode, vq_encode
from ..storage import TokenBuffers
from .fitted import DEFAULT_SINKS, DEFAULT_WINDOW, FittedCache, FittedLayer, _f32
from .layout import Layout, Spec, bounded, join
from .restore_checks import check_centroids
from .rollback import DEFAULT_ROLLBACK_TOKENS

__all__ = ["VQCache"]

#: One layer's given codebooks: a fitted compressor, or a ``(k_codebook, v_codebook)`` pair.
VQItem = KVCacheCompressor | tuple[VQCodebook, VQCodebook]

#: ``vq`` fits its codebooks once it holds this many vectors per centroid (per head).
VQ_VECTORS_PER_CENTROID = 4
#: ... and on at most this many per centroid (an evenly spaced subsample of a long prefill):
#: k-means costs O(vectors · K · iterations), 22 s per side for 8 heads × 32k tokens × d 128 at
#: K = 16 on this 2-core machine if every vector is used, 0.7 s with 64 per centroid.
VQ_FIT_VECTORS_PER_CENTROID = 64
#: Largest codebook a layer may hold (codes of up to 16 bits).
MAX_CODEBOOK_SIZE = 65536


def _codes_in_range(xp: Namespace, sizes: dict[str, int], arrays: dict[str, Array]) -> str | None:
    """A message when a saved code names no centroid: a ``β``-bit code can reach ``2**β - 1``,
    beyond a codebook of ``K < 2**β`` centroids (the kernels would read past it)."""
    for n in ("k", "v"):
        codes = arrays.get(f"{n}_codes")
        if codes is None or not int(codes.shape[2]):
            continue
        size, m = sizes[f"{n}_size"], sizes[f"{n}_m"]
        bits = code_bits(size)
        if size == 1 << bits and bits <= 8:
            continue  # every packed value names a centroid
        idx = unpack_bits_reference(codes, bits, m) if bits <= 8 else codes
        if bool(xp.any(idx >= size)):
            return f"stored '{n}_codes' name centroids beyond the codebook of {size}"
    return None


class VQCache(FittedCache):
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
    rollback_tokens : int, default 16
        Tokens a layer can always be truncated by once fitted (float16 copies of the last
        ``rollback_tokens`` encoded tokens; see :meth:`~arraykv.caches.LayeredCache.truncate`).
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

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        codebook_size: int = 16,
        sub_dim: int = 2,
        max_iter: int = 25,
        tol: float = 1e-4,
        seed: int = 0,
        calibration: VQItem | Sequence[VQItem | None] | None = None,
        min_calibration: int | None = None,
        max_calibration: int | None = None,
        residual_window: int = DEFAULT_WINDOW,
        sink_tokens: int = DEFAULT_SINKS,
        rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
        decode_path: str = "auto",
        check_finite: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        d = check_int("head_dim", head_dim, low=1)
        self.codebook_size, self.sub_dim, self.max_iter, self.tol = check_vq_options(
            codebook_size, sub_dim, d, max_iter, tol
        )
        self.seed = check_int("seed", seed, low=0)
        if min_calibration is None:
            min_calibration = VQ_VECTORS_PER_CENTROID * self.codebook_size
        self.min_calibration = check_int("min_calibration", min_calibration, low=self.codebook_size)
        if max_calibration is None:
            max_calibration = max(VQ_FIT_VECTORS_PER_CENTROID * self.codebook_size, self.min_calibration)
        self.max_calibration = check_int("max_calibration", max_calibration, low=self.min_calibration)
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

    def _item_help(self) -> str:
        return "a fitted KVCacheCompressor(VectorQuantization(...)) or a pair (k_codebook, v_codebook) of VQCodebook"

    def _convert(self, item: Any, where: str = "calibration") -> dict[str, Array]:
        out = {}
        for name, cb in zip(("k", "v"), self._pair(item, VectorQuantization, where)):
            if not isinstance(cb, VQCodebook):
                raise TypeError(f"{where} must hold VQCodebook, received {type(cb).__name__}")
            c = cb.centroids
            if c.ndim != 4 or int(c.shape[0]) != self.num_kv_heads or cb.subspaces * cb.sub_dim != self.head_dim:
                raise ValueError(
                    f"{where}: the {name} codebook must be (num_kv_heads={self.num_kv_heads}, "
                    f"subspaces, codebook_size, sub_dim) with subspaces × sub_dim = head_dim="
                    f"{self.head_dim}, received shape {tuple(int(s) for s in c.shape)}"
                )
            xp = _compat.namespace(c)
            out[f"{name}_centroids"] = xp.asarray(_f32(xp, c), copy=True)
        return out

    def _extra_config(self) -> dict[str, Any]:
        return super()._extra_config() | {
            "codebook_size": self.codebook_size,
            "sub_dim": self.sub_dim,
            "max_iter": self.max_iter,
            "tol": self.tol,
            "seed": self.seed,
            "max_calibration": self.max_calibration,
        }

    def _fit_layout(self, xp: Namespace) -> Layout:
        """``k_centroids``, ``v_centroids``: float32 (h, m, K, s), bounded, ``m · s = head_dim``,
        ``2 <= K <= 65536`` (the codebook sizes and sub_dim of a given calibration win over the
        options, so they are read from the arrays)."""
        h, d = self.num_kv_heads, self.head_dim
        arrays = {
            f"{n}_centroids": bounded(xp.float32, (h, f"{n}_m", f"{n}_size", f"{n}_sub"), required=False)
            for n in ("k", "v")
        }

        def books(sizes: dict[str, int], held: frozenset[str]) -> str | None:
            for n in ("k", "v"):
                if f"{n}_m" in sizes and (
                    sizes[f"{n}_m"] * sizes[f"{n}_sub"] != d or not 2 <= sizes[f"{n}_size"] <= MAX_CODEBOOK_SIZE
                ):
                    return (
                        f"stored '{n}_centroids' must be (heads, subspaces, codebook_size, sub_dim) with subspaces "
                        f"× sub_dim = head_dim={d} and 2 <= codebook_size <= {MAX_CODEBOOK_SIZE}, received "
                        f"({h}, {sizes[f'{n}_m']}, {sizes[f'{n}_size']}, {sizes[f'{n}_sub']})"
                    )
            return None

        return Layout(arrays=arrays, rules=(books,))

    def _token_specs(self, xp: Namespace, batch: int) -> dict[str, Spec]:
        """``k_codes``, ``v_codes``: the packed width and dtype of each codebook's size
        (:class:`~arraykv.quant.vq.VQCodes`); :meth:`_layer_layout` adds that every code names
        a centroid."""
        tok = (batch, self.num_kv_heads, "codes")
        out: dict[str, Spec] = {}
        for n in ("k", "v"):

            def dtype(sizes: dict[str, int], n: str = n) -> DType:
                return xp.uint8 if code_bits(sizes[f"{n}_size"]) <= 8 else xp.uint16

            def width(sizes: dict[str, int], n: str = n) -> int:
                bits, m = code_bits(sizes[f"{n}_size"]), sizes[f"{n}_m"]
                return packed_nbytes(m, bits) if bits <= 8 else m

            out[f"{n}_codes"] = Spec(dtype, tok + (width,), required=False)
        return out

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout:
        base = super()._layer_layout(xp, batch, dtype, length)
        return join(base, Layout(arrays={}, value_rules=(_codes_in_range,)))

    def _fit(self, xp: Namespace, k: Array, v: Array) -> dict[str, Array]:
        return {
            f"{name}_centroids": train_vq(
                samples_by_head(xp, x),
                codebook_size=self.codebook_size,
                sub_dim=self.sub_dim,
                max_iter=self.max_iter,
                tol=self.tol,
                seed=self.seed,
                assign=ops.vq_assign,
                update=ops.vq_update,
            ).centroids
            for name, x in (("k", k), ("v", v))
        }

    def _encode(self, xp: Namespace, calib: dict[str, Array], k: Array, v: Array) -> dict[str, Array]:
        return {
            f"{name}_codes": vq_encode(x, VQCodebook(centroids=calib[f"{name}_centroids"]), encode=ops.vq_encode).codes
            for name, x in (("k", k), ("v", v))
        }

    def _check_room(self, st: FittedLayer) -> None:
        if st.calib is not None and dtype_name(st.dtype) == "float16":  # centroids are its keys and values
            check_centroids(st.xp, {n: st.calib[n] for n in ("k_centroids", "v_centroids")})

    def _fused_auto(self, xp: Namespace) -> bool:
        return ops.has_kernel("vq_decode_attention", xp)

    def _attend(self, st: FittedLayer, q: Array, scale: float) -> Array:
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
        codes = VQLayerCodes(
            k_codes=buf.view("k_codes"), k_centroids=kc, v_codes=buf.view("v_codes"), v_centroids=vc, bits=bits
        )
        out = ops.vq_decode_attention(xp.reshape(q, (b, hq, d)), codes, ke, ve, softmax_scale=scale)
        out = xp.reshape(out, (b, hq, 1, d))
        return out if out.dtype == q.dtype else xp.astype(out, q.dtype)

    def _decode_tokens(
        self, xp: Namespace, calib: dict[str, Array], buf: TokenBuffers, start: int = 0
    ) -> tuple[Array, Array]:
        out = []
        for name in ("k", "v"):
            cb = VQCodebook(centroids=calib[f"{name}_centroids"])
            codes = VQCodes(
                codes=buf.view(f"{name}_codes")[:, :, start:, :],
                bits=code_bits(cb.codebook_size),
                subspaces=cb.subspaces,
            )
            out.append(vq_decode(codes, cb, decode=ops.vq_decode))
        return out[0], out[1]
