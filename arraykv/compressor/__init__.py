"""Whole-tensor KV compression: low rank, product quantization, and low rank + integers.

:class:`KVCacheCompressor` compresses the keys and values of a layer at once (for storage,
transfer or offloading), and bridges to the paged and MLA caches. Methods are small frozen
dataclasses: :class:`LowRank`, :class:`VectorQuantization`, :class:`Hybrid`.
"""

from .kv_compressor import (
    KVCacheCompressor,
    compress_mla_cache,
    compress_paged_cache,
    decompress_to_mla_cache,
    decompress_to_paged_cache,
    samples_by_head,
)
from .methods import CompressedKV, CompressedTensor, Hybrid, LowRank, VectorQuantization

__all__ = [
    "LowRank",
    "VectorQuantization",
    "Hybrid",
    "CompressedTensor",
    "CompressedKV",
    "KVCacheCompressor",
    "compress_paged_cache",
    "decompress_to_paged_cache",
    "compress_mla_cache",
    "decompress_to_mla_cache",
    "samples_by_head",
]
