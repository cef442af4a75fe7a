"""Vector (product) quantization: one k-means codebook per (head, sub-space).

Each ``head_dim`` vector is split into ``head_dim / sub_dim`` sub-vectors; every sub-space of
every head has its own codebook of ``codebook_size`` centroids, trained with k-means++
seeding and Lloyd iterations until the objective stops decreasing.

Everything here is array-API code (the references the CPU kernels are tested against); the
k-means steps live in :mod:`.kmeans` (re-exported here). The steps that have kernels are
parameters: :func:`train_vq` takes ``assign``/``update``, :func:`vq_encode` ``encode`` and
:func:`vq_decode` ``decode``, defaulting to the references; :mod:`arraykv.ops` has the
accelerated ones (``ops.vq_assign``, ``ops.vq_update``, ``ops.vq_encode``, ``ops.vq_decode``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _compat
from .._types import Array, DType
from .._validation import check_float_array, check_int, dtype_name, is_floating
from ._dims import axis_length
from .bitpack import pack_bits_reference, unpack_bits_reference
from .kmeans import assign_reference, gather_rows, kmeans_pp, split_subspaces, update_reference

__all__ = [
    "VQCodebook",
    "VQCodes",
    "VQLayerCodes",
    "check_vq_options",
    "train_vq",
    "vq_encode",
    "vq_decode",
    "code_bits",
    "assign_reference",
    "update_reference",
    "vq_encode_reference",
    "vq_decode_reference",
    "check_decode_attention_args",
]


@dataclass(frozen=True)
class VQCodebook:
    """Trained product-quantization codebooks.

    Attributes
    ----------
    centroids : array of float32, shape (heads, subspaces, codebook_size, sub_dim)
    objective : tuple of float
        Sum of squared distances of the training vectors to their centroids after each
        assignment step (non-increasing by construction of Lloyd's algorithm).
    iterations : int
        Lloyd iterations run.
    converged : bool
        True when the relative decrease fell below ``tol`` (or assignments stopped changing)
        before ``max_iter``.
    """

    centroids: Array
    objective: tuple = field(default=())
    iterations: int = 0
    converged: bool = False

    heads = axis_length("centroids", 0)
    subspaces = axis_length("centroids", 1)
    codebook_size = axis_length("centroids", 2)
    sub_dim = axis_length("centroids", 3)

    @property
    def nbytes(self) -> int:
        return _compat.array_nbytes(self.centroids)


@dataclass(frozen=True)
class VQCodes:
    """Packed VQ codes of vectors of shape (..., heads, seq, head_dim).

    Attributes
    ----------
    codes : array
        uint8 packed along the last axis, shape (..., heads, seq, ceil(subspaces * bits / 8)),
        when ``bits <= 8``; uint16, shape (..., heads, seq, subspaces), otherwise.
    bits : int
        Bits per code, ``ceil(log2(codebook_size))``.
    subspaces : int
    """

    codes: Array
    bits: int
    subspaces: int

    @property
    def nbytes(self) -> int:
        return _compat.array_nbytes(self.codes)


@dataclass(frozen=True)
class VQLayerCodes:
    """A VQ layer's coded tokens and codebooks: what the fused decode attention reads besides the query.

    The argument object of :func:`arraykv.ops.vq_decode_attention`, its array-API reference
    (:func:`arraykv.attention.vq_fused.vq_decode_attention_reference`) and its Numba kernel
    (:mod:`arraykv.ops.numba.vq_fused`), built per step by :class:`~arraykv.caches.vq.VQCache`.
    It holds references, never copies; shapes and dtypes are checked by the ops
    (:func:`check_decode_attention_args`).

    Attributes
    ----------
    k_codes, v_codes : array, shape (batch, h, T, ceil(m * bits / 8)) uint8 or (batch, h, T, m) uint16
        VQ codes of the ``T`` coded tokens (:attr:`VQCodes.codes`): packed with
        :func:`arraykv.quant.bitpack.pack_bits` when ``bits <= 8``, one uint16 per code otherwise;
        ``T`` may be 0.
    k_centroids, v_centroids : array of float, shape (h, m, K, s)
        The codebooks (:attr:`VQCodebook.centroids`), ``m * s == head_dim``; ``K`` may differ
        between keys and values.
    bits : int
        Bits per code of both, 1 to 16 (:func:`code_bits` of the larger codebook).
    """

    k_codes: Array
    k_centroids: Array
    v_codes: Array
    v_centroids: Array
    bits: int


def code_bits(codebook_size: int) -> int:
    """Bits needed for one code: ``max(1, ceil(log2(codebook_size)))``."""
    return max(1, math.ceil(math.log2(codebook_size)))


def check_vq_options(
    codebook_size: Any, sub_dim: Any, head_dim: int | None = None, max_iter: Any = 25, tol: Any = 1e-4
) -> tuple:
    """Validate VQ options; return ``(codebook_size, sub_dim, max_iter, tol)``."""
    codebook_size = check_int("codebook_size", codebook_size, low=2, high=65536)
    sub_dim = check_int("sub_dim", sub_dim, low=1)
    if head_dim is not None and head_dim % sub_dim != 0:
        raise ValueError(f"sub_dim must divide head_dim={head_dim}, received sub_dim={sub_dim}")
    max_iter = check_int("max_iter", max_iter, low=1)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"tol must be a real number >= 0, received {type(tol).__name__}")
    if not float(tol) >= 0.0:
        raise ValueError(f"tol must be >= 0, received {tol!r}")
    return codebook_size, sub_dim, max_iter, float(tol)


def train_vq(
    x: Array,
    *,
    codebook_size: int = 256,
    sub_dim: int = 8,
    max_iter: int = 25,
    tol: float = 1e-4,
    seed: int = 0,
    assign: Callable = assign_reference,
    update: Callable = update_reference,
) -> VQCodebook:
    """Train one codebook per (head, sub-space) on ``x``.

    Parameters
    ----------
    x : array of float, shape (heads, n, head_dim)
        ``n`` training vectors per head; needs ``n >= codebook_size``.
    codebook_size : int, default 256
        Centroids per sub-space, 2 to 65536.
    sub_dim : int, default 8
        Sub-vector length; must divide ``head_dim``.
    max_iter : int, default 25
        Most Lloyd iterations.
    tol : float, default 1e-4
        Stop when the objective decreases by less than ``tol`` relative to its previous value.
    seed : int, default 0
        Seed of the k-means++ draws (host NumPy generator).
    assign, update : callable
        The two Lloyd steps, with the signatures of :func:`assign_reference` and
        :func:`update_reference` (the defaults); ``arraykv.ops.vq_assign`` and
        ``arraykv.ops.vq_update`` pick a kernel for the namespace.

    Returns
    -------
    VQCodebook

    Raises
    ------
    ValueError
        If ``n < codebook_size``: a codebook with more centroids than training vectors would
        be degenerate. Lower ``codebook_size`` or train on more (calibration) data.

    Notes
    -----
    Product quantization (Jégou, Douze & Schmid, 2011) codes a ``d``-vector as ``m = d / s``
    indices into per-sub-space codebooks, ``m * log2(K)`` bits in all, with the expressive
    power of ``K^m`` centroids. Each codebook minimises ``Σ ‖x_j - c_{a(j)}‖²`` by Lloyd's
    algorithm: assign every point to its nearest centroid, move every centroid to the mean of
    its points; neither step can increase the objective, which is recorded after every
    assignment. Seeding is k-means++ (Arthur & Vassilvitskii, 2007): each new centroid is a
    training point drawn with probability proportional to its squared distance to the nearest
    centroid chosen so far, an ``O(log K)``-competitive start. Distances use
    ``‖x‖² - 2 x·c + ‖c‖²`` (a batched matmul), computed in float32.
    """
    xp = _compat.namespace(x)
    check_float_array(xp, "x", x, "(heads, n, head_dim)")
    h, n, d = (int(s) for s in x.shape)
    codebook_size, sub_dim, max_iter, tol = check_vq_options(codebook_size, sub_dim, d, max_iter, tol)
    seed = check_int("seed", seed, low=0)
    if n < codebook_size:
        raise ValueError(
            f"product quantization needs at least codebook_size={codebook_size} training vectors per head, "
            f"received {n}; lower codebook_size or fit on more calibration data"
        )
    x32 = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
    xg = split_subspaces(x32, sub_dim)
    c = kmeans_pp(xg, codebook_size, seed)
    history: list = []
    converged = False
    prev_idx = None
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - `it` is read after the loop (iterations)
        idx, err = assign(xg, c)
        history.append(err)
        if len(history) > 1 and (history[-2] - err <= tol * history[-2]):
            converged = True
            break
        if prev_idx is not None and bool(xp.all(idx == prev_idx)):
            converged = True
            break
        c = update(xg, c, idx)
        prev_idx = idx
    m = d // sub_dim
    centroids = xp.reshape(c, (h, m, codebook_size, sub_dim))
    return VQCodebook(centroids=centroids, objective=tuple(history), iterations=it, converged=converged)


def vq_encode(x: Array, cb: VQCodebook, *, encode: Callable | None = None) -> VQCodes:
    """Nearest-centroid codes of ``x`` (..., heads, seq, head_dim), packed.

    Parameters
    ----------
    x : array of float, shape (..., heads, seq, head_dim)
    cb : VQCodebook
    encode : callable, optional
        ``encode(x4, centroids, bits)`` with the signature of :func:`vq_encode_reference`
        (the default); ``arraykv.ops.vq_encode`` picks a kernel for the namespace.

    Returns
    -------
    VQCodes
    """
    xp = _compat.namespace(x)
    lead = tuple(int(s) for s in x.shape[:-3])
    h, t, d = (int(s) for s in x.shape[-3:])
    if h != cb.heads or d != cb.subspaces * cb.sub_dim:
        raise ValueError(
            f"x must have {cb.heads} heads and head_dim {cb.subspaces * cb.sub_dim} like the codebook, "
            f"received shape {tuple(x.shape)}"
        )
    rows = 1
    for s in lead:
        rows *= s
    bits = code_bits(cb.codebook_size)
    codes = (encode or vq_encode_reference)(xp.reshape(x, (rows, h, t, d)), cb.centroids, bits)
    return VQCodes(codes=xp.reshape(codes, lead + (h, t, int(codes.shape[-1]))), bits=bits, subspaces=cb.subspaces)


def vq_encode_reference(x: Array, centroids: Array, bits: int) -> Array:
    """Codes of ``x`` (rows, h, t, d) for codebooks ``centroids`` (h, m, K, s).

    Returns
    -------
    array of uint8, shape (rows, h, t, ceil(m · bits / 8)) (packed, ``bits <= 8``), or of
    uint16, shape (rows, h, t, m)
    """
    xp = _compat.namespace(x)
    rows, h, t, d = (int(s) for s in x.shape)
    _, m, k, sub_dim = (int(s) for s in centroids.shape)
    x32 = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
    # (rows, h, t, d) → (h, rows * t, d): every head's vectors together.
    xh = xp.reshape(xp.permute_dims(x32, (1, 0, 2, 3)), (h, rows * t, d))
    xg = split_subspaces(xh, sub_dim)
    c = xp.reshape(centroids, (h * m, k, sub_dim))
    idx, _ = assign_reference(xg, c)  # (h*m, rows*t)
    idx = xp.permute_dims(xp.reshape(idx, (h, m, rows, t)), (2, 0, 3, 1))  # (rows, h, t, m)
    if bits <= 8:
        return pack_bits_reference(xp.astype(idx, xp.uint8), bits)
    return xp.astype(idx, xp.uint16)


def vq_decode(codes: VQCodes, cb: VQCodebook, dtype: DType | None = None, *, decode: Callable | None = None) -> Array:
    """Concatenate the centroids that ``codes`` name: array (..., heads, seq, head_dim).

    Parameters
    ----------
    codes : VQCodes
    cb : VQCodebook
    dtype : dtype, optional
        Output dtype (default float32).
    decode : callable, optional
        ``decode(codes4, centroids, bits)`` with the signature of :func:`vq_decode_reference`
        (the default); ``arraykv.ops.vq_decode`` picks a kernel for the namespace.
    """
    xp = _compat.namespace(codes.codes)
    c = codes.codes
    lead = tuple(int(s) for s in c.shape[:-3])
    h, t = int(c.shape[-3]), int(c.shape[-2])
    rows = 1
    for s in lead:
        rows *= s
    out = (decode or vq_decode_reference)(xp.reshape(c, (rows, h, t, int(c.shape[-1]))), cb.centroids, codes.bits)
    out = xp.reshape(out, lead + (h, t, codes.subspaces * cb.sub_dim))
    return out if dtype is None or out.dtype == dtype else xp.astype(out, dtype)


def vq_decode_reference(codes: Array, centroids: Array, bits: int) -> Array:
    """Vectors that ``codes`` (rows, h, t, bytes or m) name in ``centroids`` (h, m, K, s).

    float32, (rows, h, t, m · s).
    """
    xp = _compat.namespace(codes)
    rows, h, t = (int(s) for s in codes.shape[:3])
    _, m, k, sub_dim = (int(s) for s in centroids.shape)
    idx = unpack_bits_reference(codes, bits, m) if bits <= 8 else codes
    idx = xp.astype(idx, xp.int64)
    idx = xp.reshape(xp.permute_dims(idx, (1, 3, 0, 2)), (h * m, rows * t))  # (h*m, rows*t)
    cent = xp.reshape(centroids, (h * m, k, sub_dim))
    vec = gather_rows(cent, idx)  # (h*m, rows*t, s)
    vec = xp.reshape(vec, (h, m, rows, t, sub_dim))
    vec = xp.permute_dims(vec, (2, 0, 3, 1, 4))
    return xp.reshape(vec, (rows, h, t, m * sub_dim))


def check_decode_attention_args(
    q: Array,
    k_codes: Array,
    k_centroids: Array,
    v_codes: Array,
    v_centroids: Array,
    k_extra: Array,
    v_extra: Array,
    bits: Any,
) -> tuple:
    """Shape and dtype checks of :func:`~arraykv.attention.vq_fused.vq_decode_attention_reference` and its kernels.

    Returns
    -------
    tuple of int
        ``(b, hq, h, T, E, d, m, bits)``.
    """
    xp = _compat.namespace(q)
    bits = check_int("bits", bits, low=1, high=16)
    if q.ndim != 3 or not is_floating(xp, q.dtype):
        raise ValueError(
            f"q must be a float array of shape (batch, q_heads, head_dim), received "
            f"{dtype_name(q.dtype)} shape {tuple(q.shape)}"
        )
    b, hq, d = (int(s) for s in q.shape)
    for name, c in (("k_centroids", k_centroids), ("v_centroids", v_centroids)):
        if c.ndim != 4 or not is_floating(xp, c.dtype):
            raise ValueError(
                f"{name} must be a float array of shape (heads, subspaces, codebook_size, sub_dim), "
                f"received {dtype_name(c.dtype)} shape {tuple(c.shape)}"
            )
    h, m, _, s = (int(v) for v in k_centroids.shape)
    if (int(v_centroids.shape[0]), int(v_centroids.shape[1]), int(v_centroids.shape[3])) != (h, m, s):
        raise ValueError(
            f"v_centroids must have (heads, subspaces, sub_dim) = {(h, m, s)} like k_centroids, "
            f"received shape {tuple(v_centroids.shape)}"
        )
    if m * s != d:
        raise ValueError(f"subspaces * sub_dim of the codebooks ({m} * {s}) must equal head_dim {d} of q")
    if h < 1 or hq % h != 0:
        raise ValueError(f"q_heads must be a multiple of the codebooks' kv heads, received {hq} and {h}")
    width, want = ((m * bits + 7) // 8, xp.uint8) if bits <= 8 else (m, xp.uint16)
    for name, c in (("k_codes", k_codes), ("v_codes", v_codes)):
        if c.ndim != 4 or c.dtype != want or (int(c.shape[0]), int(c.shape[1]), int(c.shape[3])) != (b, h, width):
            raise ValueError(
                f"{name} must be {dtype_name(want)} of shape (batch={b}, heads={h}, tokens, {width}) "
                f"for {m} codes of {bits} bits, received {dtype_name(c.dtype)} shape {tuple(c.shape)}"
            )
    t = int(k_codes.shape[2])
    if int(v_codes.shape[2]) != t:
        raise ValueError(f"v_codes must hold {t} tokens like k_codes, received {int(v_codes.shape[2])}")
    for name, x in (("k_extra", k_extra), ("v_extra", v_extra)):
        lead = (int(x.shape[0]), int(x.shape[1]), int(x.shape[3])) if x.ndim == 4 else None
        if lead != (b, h, d) or not is_floating(xp, x.dtype):
            raise ValueError(
                f"{name} must be a float array of shape (batch={b}, heads={h}, extra, {d}), "
                f"received {dtype_name(x.dtype)} shape {tuple(x.shape)}"
            )
    e = int(k_extra.shape[2])
    if int(v_extra.shape[2]) != e:
        raise ValueError(f"v_extra must hold {e} tokens like k_extra, received {int(v_extra.shape[2])}")
    if t + e == 0:
        raise ValueError("attention needs at least one token: k_codes and k_extra are both empty")
    return b, hq, h, t, e, d, m, bits
