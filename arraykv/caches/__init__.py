"""Caches: storage + codec (+ recent-token window), and the factory."""

from .base import LayeredCache
from .dense import DenseCache
from .hybrid import HybridCache
from .registry import available_methods, make_cache, register_method
from .window_cache import SlidingWindowCache

__all__ = [
    "LayeredCache",
    "DenseCache",
    "HybridCache",
    "SlidingWindowCache",
    "make_cache",
    "available_methods",
    "register_method",
]
