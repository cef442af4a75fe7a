"""Lazy accelerators: Numba kernels on CPU, CUDA kernels through CuPy on GPU.

Accelerated versions of a function are looked up by name for an array namespace with
:func:`lookup`; it returns None when none is available, and callers fall back to the array-API
reference. Nothing here imports Numba or CuPy at import time.
"""

from ._kernel_files import kernel_names, kernel_source
from .registry import lookup, kernels_enabled, set_kernels_enabled

__all__ = ["kernel_names", "kernel_source", "lookup", "kernels_enabled", "set_kernels_enabled"]
