"""arraykv: compressed KV caches for transformer inference, on any array-API library."""

from . import storage as storage  # the subpackage, public
from .attention import attention
from .caches import DenseCache, HybridCache, SlidingWindowCache, available_methods, make_cache, register_method
from .compressor import (
    CompressedKV,
    Hybrid,
    KVCacheCompressor,
    LowRank,
    VectorQuantization,
    compress_mla_cache,
    compress_paged_cache,
    decompress_to_mla_cache,
    decompress_to_paged_cache,
)
from .persist import CacheFileError, load_cache as load
from .protocol import (
    AttendConfig,
    CompressedKVCache,
    DecodeOutput,
    Dequantized,
    DequantResult,
    Fused,
)
from .storage import MlaCache, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "AttendConfig",
    "CompressedKV",
    "Hybrid",
    "KVCacheCompressor",
    "MlaCache",
    "PagedKVCache",
    "LowRank",
    "VectorQuantization",
    "compress_mla_cache",
    "compress_paged_cache",
    "decompress_to_mla_cache",
    "decompress_to_paged_cache",
    "CompressedKVCache",
    "DecodeOutput",
    "DenseCache",
    "HybridCache",
    "SlidingWindowCache",
    "Dequantized",
    "DequantResult",
    "Fused",
    "CacheFileError",
    "attention",
    "load",
    "available_methods",
    "make_cache",
    "register_method",
    "__version__",
]
