"""The compression methods (small frozen dataclasses) and what compressing returns.

:class:`LowRank`, :class:`VectorQuantization`, :class:`Hybrid` say how; :class:`CompressedTensor`
and :class:`CompressedKV` hold the result of :class:`~arraykv.compressor.KVCacheCompressor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import _compat
from .._types import Array, DType
from .._validation import check_bool, check_int, check_real
from ..quant.lowrank import check_rank_energy
from ..quant.vq import check_vq_options

__all__ = ["LowRank", "VectorQuantization", "Hybrid", "CompressedTensor", "CompressedKV"]


def _check_bool(name: str, value: Any) -> bool:
    return check_bool(name, value)


@dataclass(frozen=True)
class LowRank:
    """Keep ``rank`` principal directions per head (or the fewest holding ``energy``).

    Parameters
    ----------
    rank : int, optional
        Directions kept, ``1 <= rank <= head_dim`` (checked when ``head_dim`` is known).
    energy : float, optional
        Fraction of the variance to keep, in (0, 1]. Exactly one of ``rank``/``energy``.
    center : bool, default True
        Subtract the per-head mean (PCA) before projecting; the mean is stored.
    per_head : bool, default True
        One basis per KV head; ``False`` shares one basis across the heads of a layer.
    """

    rank: int | None = None
    energy: float | None = None
    center: bool = True
    per_head: bool = True

    def __post_init__(self) -> None:
        rank, energy = check_rank_energy(self.rank, self.energy, 1 << 30)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "energy", energy)
        object.__setattr__(self, "center", _check_bool("center", self.center))
        object.__setattr__(self, "per_head", _check_bool("per_head", self.per_head))


@dataclass(frozen=True)
class VectorQuantization:
    """Product quantization: one k-means codebook per (head, sub-space).

    Parameters
    ----------
    codebook_size : int, default 256
        Centroids per sub-space, 2 to 65536; codes take ``ceil(log2(codebook_size))`` bits.
    sub_dim : int, default 8
        Sub-vector length; must divide ``head_dim``.
    max_iter : int, default 25
        Most Lloyd iterations.
    tol : float, default 1e-4
        Relative decrease of the k-means objective below which training stops.
    seed : int, default 0
        Seed of the k-means++ draws.
    """

    codebook_size: int = 256
    sub_dim: int = 8
    max_iter: int = 25
    tol: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        cs, sd, mi, tol = check_vq_options(self.codebook_size, self.sub_dim, None, self.max_iter, self.tol)
        object.__setattr__(self, "codebook_size", cs)
        object.__setattr__(self, "sub_dim", sd)
        object.__setattr__(self, "max_iter", mi)
        object.__setattr__(self, "tol", tol)
        object.__setattr__(self, "seed", check_int("seed", self.seed, low=0))


@dataclass(frozen=True)
class Hybrid:
    """Low-rank projection, then group-wise INT4/INT8 coefficients, plus exact outliers.

    Parameters
    ----------
    rank : int
        Principal directions kept per head.
    quant_bits : {4, 8}, default 8
        Bits per coefficient code.
    group_size : int, default 32
        Tokens per quantization group of each coefficient channel.
    outlier_threshold : float or None, default 6.0
        A value is an outlier when ``|x - μ| > outlier_threshold * σ`` for its (head, channel)
        statistics over tokens; outliers are stored exactly. None keeps none.
    center : bool, default True
        Subtract the per-head mean before projecting.
    """

    rank: int
    quant_bits: int = 8
    group_size: int = 32
    outlier_threshold: float | None = 6.0
    center: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", check_int("rank", self.rank, low=1))
        object.__setattr__(self, "quant_bits", _check_quant_bits(self.quant_bits))
        object.__setattr__(self, "group_size", check_int("group_size", self.group_size, low=1))
        t = self.outlier_threshold
        if t is not None:
            object.__setattr__(self, "outlier_threshold", check_real("outlier_threshold", t, low=0.0, low_open=True))
        object.__setattr__(self, "center", _check_bool("center", self.center))


def _check_quant_bits(bits: Any) -> int:
    try:
        checked = check_int("quant_bits", bits)
    except TypeError:
        raise ValueError(f"quant_bits must be 4 or 8, received {bits!r}") from None
    if checked not in (4, 8):
        raise ValueError(f"quant_bits must be 4 or 8, received {checked!r}")
    return checked


@dataclass(frozen=True)
class CompressedTensor:
    """One compressed tensor (the keys or the values of a layer).

    Attributes
    ----------
    kind : {"lowrank", "pq", "hybrid"}
    shape : tuple of int
        ``(batch, heads, seq, head_dim)`` of the original tensor.
    dtype : dtype
        Original dtype; decompression returns it.
    parts : dict of str to array
        Everything needed to decode, as plain arrays (see :class:`CompressedKV`).
    shared : frozenset of str
        Names of parts that belong to a fitted model (basis, codebooks) rather than to the
        tokens; they are counted in :attr:`nbytes` and left out of :attr:`payload_nbytes`.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: DType
    parts: dict[str, Array]
    shared: frozenset[str] = field(default_factory=frozenset)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of every part, side tables, bases and codebooks included."""
        return sum(_compat.array_nbytes(a) for a in self.parts.values())

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the per-token parts only (what grows with the sequence)."""
        return sum(_compat.array_nbytes(a) for n, a in self.parts.items() if n not in self.shared)


@dataclass(frozen=True)
class CompressedKV:
    """Compressed keys and values.

    Parameters
    ----------
    k, v : CompressedTensor
        The compressed keys and the compressed values; both hold 4-D ``(batch, heads, seq,
        head_dim)`` shapes, a batch of one for ``"hsd"`` input.
    layout : {"bhsd", "hsd"}
        ``"bhsd"`` for (batch, heads, seq, head_dim) input, ``"hsd"`` for (heads, seq, head_dim).
    method : str
        ``"lowrank"``, ``"pq"`` or ``"hybrid"``.

    Notes
    -----
    Parts by method (``b, h, s, d`` = batch, heads, seq, head_dim; ``r`` = rank):

    * lowrank: ``coeffs`` (b, h, s, r) in the input dtype, ``basis`` (h, d, r) float32,
      ``mean`` (h, d) float32 when centred.
    * pq: ``codes`` (b, h, s, ceil(m·bits/8)) uint8 (uint16 (b, h, s, m) above 256 centroids),
      ``centroids`` (h, m, K, d/m) float32.
    * hybrid: ``codes`` (b, h, r, ceil(s·bits/8)) uint8 (coefficient channels quantized over
      token groups), ``scale``/``offset`` (b, h, r, ceil(s/group)) float32, ``basis``,
      ``mean``, ``outlier_index`` (n,) int32/int64 and ``outlier_value`` (n,) input dtype.
    """

    k: CompressedTensor
    v: CompressedTensor
    layout: str
    method: str

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the original keys in the given layout."""
        return self.k.shape if self.layout == "bhsd" else self.k.shape[1:]

    @property
    def nbytes(self) -> int:
        """Bytes held for keys and values, bases, codebooks and side tables included."""
        return self.k.nbytes + self.v.nbytes

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the per-token parts (fitted bases/codebooks shared across calls left out)."""
        return self.k.payload_nbytes + self.v.payload_nbytes

    @property
    def bits_per_value(self) -> float:
        """``8 * nbytes / (values in k and v)``."""
        return 8.0 * self.nbytes / (self.k.size + self.v.size)

    @property
    def compression_ratio(self) -> float:
        """Bytes of k and v as float16 divided by :attr:`nbytes`."""
        return 2.0 * (self.k.size + self.v.size) / self.nbytes

    def parts(self) -> dict[str, Array]:
        """Every array, named ``"k.<part>"`` / ``"v.<part>"``.

        Returns
        -------
        dict of str to array
            The parts of :attr:`k` and :attr:`v` (see the Notes above), keyed with their
            ``"k."`` or ``"v."`` prefix.
        """
        out = {f"k.{n}": a for n, a in self.k.parts.items()}
        out.update({f"v.{n}": a for n, a in self.v.parts.items()})
        return out
