"""Deprecated alias of :mod:`arraykv.ops` (kept so that ``arraykv.backends.lookup`` and friends keep working).

Use :mod:`arraykv.ops`: one entry per accelerated op (``ops.pack_bits``, ``ops.polar_encode``,
...) that picks the kernel for the namespace or the array-API reference.
"""

from ..ops.kernel_files import kernel_names, kernel_source
from ..ops.registry import kernels_enabled, lookup, set_kernels_enabled

__all__ = ["kernel_names", "kernel_source", "lookup", "kernels_enabled", "set_kernels_enabled"]
