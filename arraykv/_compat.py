"""The single place that talks to ``array_api_compat``.

Every agnostic module (``quant``, ``storage``, ``caches``, ``attention``) obtains its array
namespace and device through these helpers, so the same code serves NumPy, CuPy and any other
array-API-conforming library (``array_api_strict`` in the tests).

It is also the one module below :mod:`arraykv.ops` that uses NumPy itself (besides plain NumPy
arrays taking a direct path through :func:`all_finite`, the finiteness check of every store): fixed tables
computed once on the host (Lloyd-Max codebooks, seeded rotations and sketches, seeded
k-means++ draws) come from :func:`host_numpy` and :func:`host_uniform`, and are moved into a
namespace with ``xp.asarray``.
"""

from __future__ import annotations

import array_api_compat as _aac
import numpy as np

from ._types import Array, Device, DType, Namespace

__all__ = [
    "namespace",
    "device",
    "is_numpy",
    "is_cupy",
    "is_torch",
    "array_nbytes",
    "to_numpy",
    "float_dtypes",
    "all_finite",
    "plain_numpy",
    "host_numpy",
    "host_uniform",
    "from_host",
]


#: Namespaces already resolved, by the tuple of argument types: a namespace depends only on the
#: arrays' types, and ``array_namespace`` costs microseconds a call where a decode step makes
#: a dozen calls.
_BY_TYPES: dict = {}


def namespace(*arrays: Array) -> Namespace:
    """Return the array-API namespace shared by ``arrays``.

    Parameters
    ----------
    *arrays : array
        Arrays that must all come from one library.

    Returns
    -------
    module
        The array-API-compatible namespace (``array_api_compat.numpy`` for NumPy, and so on).

    Raises
    ------
    TypeError
        If an argument is not an array or the arrays come from different libraries.
    """
    if len(arrays) == 1 and arrays[0] is not None:  # the common call, without building tuples
        xp = _BY_TYPES.get((type(arrays[0]),))
        if xp is not None:
            return xp
    arrays = tuple(a for a in arrays if a is not None)
    key = tuple(type(a) for a in arrays)
    xp = _BY_TYPES.get(key)
    if xp is not None:
        return xp
    for a in arrays:
        if not _aac.is_array_api_obj(a):
            raise TypeError(f"expected an array, received {type(a).__name__}")
    try:
        xp = _aac.array_namespace(*arrays)
    except TypeError as exc:
        kinds = sorted({type(a).__module__ + "." + type(a).__name__ for a in arrays})
        raise TypeError("all arrays must come from the same array library; received " + ", ".join(kinds)) from exc
    if len(_BY_TYPES) < 256:
        _BY_TYPES[key] = xp
    return xp


def device(x: Array) -> Device:
    """Return the device of array ``x`` (``"cpu"`` for NumPy)."""
    return _aac.device(x)


def is_numpy(xp: Namespace) -> bool:
    """True when ``xp`` is the NumPy namespace (plain or wrapped)."""
    return _aac.is_numpy_namespace(xp)


def is_cupy(xp: Namespace) -> bool:
    """True when ``xp`` is the CuPy namespace (plain or wrapped)."""
    return _aac.is_cupy_namespace(xp)


def is_torch(xp: Namespace) -> bool:
    """True when ``xp`` is the PyTorch namespace (``array_api_compat.torch``, or ``torch`` itself)."""
    return _aac.is_torch_namespace(xp)


def array_nbytes(x: Array) -> int:
    """Bytes held by the elements of ``x`` (``size * itemsize``), for any array-API array."""
    n = 1
    for s in x.shape:
        n *= int(s)
    return n * _itemsize(x.dtype)


def _itemsize(dtype: DType) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is not None:
        return int(size)
    # array_api_strict dtypes carry a NumPy dtype underneath.
    inner = getattr(dtype, "_np_dtype", None)
    if inner is not None:
        return int(inner.itemsize)
    raise TypeError(f"cannot determine the item size of dtype {dtype!r}")


def to_numpy(x: Array, *, copy: bool = False) -> Array:
    """``x`` as a NumPy array on the host (used for inspection, I/O and tests).

    A NumPy input is returned as it is unless ``copy``; other arrays are always copied.
    """

    if isinstance(x, np.ndarray):
        return np.array(x, copy=True) if copy else x
    if _aac.is_cupy_array(x):
        return x.get()
    if _aac.is_torch_array(x):  # a tensor on any device, also one that records gradients
        return np.array(x.detach().cpu().numpy(), copy=True)
    return np.asarray(x)


_FLOATS: dict[int, tuple[DType, ...]] = {}


def float_dtypes(xp: Namespace) -> tuple[DType, ...]:
    """The real floating dtypes that ``xp`` offers (float16 only where it exists); looked up once per namespace."""
    out = _FLOATS.get(id(xp))
    if out is None:
        out = _FLOATS[id(xp)] = tuple(
            dt for dt in (getattr(xp, n, None) for n in ("float16", "float32", "float64")) if dt is not None
        )
    return out


def plain_numpy(*arrays: Array) -> bool:
    """Whether every argument is a plain ``numpy.ndarray`` (no subclass, no other library's array):
    the arrays whose checks may take a direct NumPy path."""

    for a in arrays:  # a loop: a generator in all() costs a decode step's checks more than the test
        if type(a) is not np.ndarray:
            return False
    return True


#: Total elements up to which :func:`all_finite` checks several arrays in one pass over a
#: concatenation (a decode step's few small arrays); larger ones are checked one by one.
_JOINT_CHECK_MAX = 1 << 15


def all_finite(xp: Namespace, arrays: list[Array]) -> bool:
    """Whether every array of ``arrays`` (floating dtypes, of namespace ``xp``) holds only finite values.

    A store checks a handful of small arrays per call; each ``xp.all(xp.isfinite(a))`` costs
    microseconds of call overhead, so small arrays are checked together (one concatenation,
    one test; float16 infinities stay infinite when promoted), plain NumPy arrays without the
    namespace's wrappers.
    """
    if not arrays:
        return True

    if plain_numpy(*arrays):
        if len(arrays) == 1:
            return bool(np.isfinite(arrays[0]).all())
        if sum(a.size for a in arrays) <= _JOINT_CHECK_MAX:
            return bool(np.isfinite(np.concatenate([a.ravel() for a in arrays])).all())
        return all(bool(np.isfinite(a).all()) for a in arrays)
    if len(arrays) > 1 and sum(_aac.size(a) or 0 for a in arrays) <= _JOINT_CHECK_MAX:
        return bool(xp.all(xp.isfinite(xp.concat([xp.reshape(a, (-1,)) for a in arrays]))))
    return all(bool(xp.all(xp.isfinite(a))) for a in arrays)


def host_numpy() -> Namespace:
    """NumPy, for computations on the host of fixed tables (codebooks, seeded rotations)."""

    return np


def from_host(xp: Namespace, table: Array, *, device: Device | None = None) -> Array:
    """A fixed host table (a NumPy array, often a shared read-only memo) in namespace ``xp``.

    NumPy keeps the table as it is (read-only, shared). A namespace that would share the
    memory but cannot mark it read-only (PyTorch's ``asarray`` of a NumPy array) gets a copy,
    so no cache can write into a table that other caches share.
    """
    if _aac.is_torch_namespace(xp):
        return xp.asarray(table, device=device, copy=True)
    return xp.asarray(table, device=device)


def host_uniform(xp: Namespace, shape: tuple[int, ...], *, seed: int, device: Device | None = None) -> Array:
    """Uniform float32 numbers in ``[0, 1)`` of ``shape`` from ``numpy.random.default_rng(seed)``.

    The array API has no random module, so algorithms that need reproducible randomness
    (k-means++ seeding) draw here; the same ``seed`` gives the same numbers on every namespace
    and device.
    """

    u = np.random.default_rng(seed).random(shape, dtype=np.float64).astype(np.float32)
    return xp.asarray(u, device=device)
