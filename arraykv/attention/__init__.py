"""Attention: the array-API reference and the dispatch to fused kernels."""

from .reference import attention

__all__ = ["attention"]
