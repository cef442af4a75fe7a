"""arraykv: compressed KV caches for transformer inference, on any array-API library."""

from .attention import attention
from .caches import DenseCache, available_methods, make_cache, register_method
from .protocol import (
    AttendConfig,
    CompressedKVCache,
    DecodeOutput,
    Dequantized,
    DequantResult,
    Fused,
)

__version__ = "0.1.0"

__all__ = [
    "AttendConfig",
    "CompressedKVCache",
    "DecodeOutput",
    "DenseCache",
    "Dequantized",
    "DequantResult",
    "Fused",
    "attention",
    "available_methods",
    "make_cache",
    "register_method",
    "__version__",
]
