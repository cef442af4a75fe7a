"""Names for the types the public signatures take: arrays of any array-API library and their namespaces.

The array API standard defines what an array and a namespace can do, not a class a checker could
follow through NumPy, CuPy, PyTorch and ``array_api_strict`` alike, so both names stand for
:data:`typing.Any` to a type checker; to a reader they say which of the two a parameter is.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array", "Namespace"]

#: An array of any array-API library (``numpy.ndarray``, ``cupy.ndarray``, ``torch.Tensor``, ...).
Array: TypeAlias = Any
#: An array-API namespace: the module whose functions make and combine arrays (``numpy``,
#: ``cupy``, ``array_api_compat.torch``, ...), as :func:`arraykv._compat.namespace` returns it.
Namespace: TypeAlias = Any
