"""Names for the types the public signatures take: arrays of any array-API library, their
namespaces, dtypes and devices.

The array API standard defines what an array, a namespace, a dtype and a device can do, not a
class a checker could follow through NumPy, CuPy, PyTorch and ``array_api_strict`` alike, so these
names stand for :data:`typing.Any` to a type checker; to a reader they say which one a parameter is.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array", "Namespace", "DType", "Device"]

#: An array of any array-API library (``numpy.ndarray``, ``cupy.ndarray``, ``torch.Tensor``, ...).
Array: TypeAlias = Any
#: An array-API namespace: the module whose functions make and combine arrays (``numpy``,
#: ``cupy``, ``array_api_compat.torch``, ...), as :func:`arraykv._compat.namespace` returns it.
Namespace: TypeAlias = Any
#: A dtype of an array-API namespace (``xp.float32``, ``numpy.dtype("float16")``, ``torch.bfloat16``, ...).
DType: TypeAlias = Any
#: A device of an array-API library, as :func:`arraykv._compat.device` returns it (``"cpu"``, a
#: ``cupy.cuda.Device``, a ``torch.device``, ...).
Device: TypeAlias = Any
