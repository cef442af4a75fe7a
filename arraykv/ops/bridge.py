"""PyTorch tensors through the NumPy (Numba) and CuPy (CUDA) kernels, without copies.

The caches reach PyTorch through ``array_api_compat.torch`` like any other namespace; this
module is what lets the kernels serve them too. :func:`route` says which kernel backend a
tensor's device takes (``"numpy"`` for CPU tensors, ``"cupy"`` for CUDA tensors, None
elsewhere), and :func:`bridged` wraps such a kernel so that it takes and returns tensors:

* every ``torch.Tensor`` argument becomes a NumPy or CuPy array through DLPack
  (``numpy.from_dlpack`` / ``cupy.from_dlpack``): the same memory, strides included, so a
  non-contiguous tensor is passed as the strided view it is and the kernel's own
  ``ascontiguousarray`` (if any) is the only copy, as it would be for a NumPy caller;
* dataclass arguments (the codec states of the fused decode kernels, their ``Rotation``,
  ``Codebook`` and ``QJLSketch`` members) are rebuilt with ``dataclasses.replace`` around
  their converted fields; tuples, lists and dicts are converted item by item;
* every NumPy or CuPy array in the result goes back through ``torch.from_dlpack`` (again
  the same memory), inside tuples and dataclasses too. A read-only NumPy result (a shared
  table) is copied first, since a tensor cannot be marked read-only.

Only the registry (:func:`arraykv.ops.registry.lookup`) calls this module; nothing in it
imports torch, NumPy or CuPy until a tensor arrives.

CUDA
----
A CUDA tensor's kernel runs with CuPy's current device set to the tensor's device and
CuPy's current stream set to PyTorch's current stream on that device, so the kernel is
ordered after the work that produced its inputs and before the work that reads its
outputs, with no synchronization. This branch has not been run on a GPU in this
repository's tests (they skip it without CUDA).

Autograd
--------
The kernels are not differentiable: a tensor that requires grad cannot be exported through
DLPack and PyTorch's error says so (the caches refuse such tensors at their entry points).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .._types import Array, Device

__all__ = ["route", "bridged", "dispatching"]

#: How deep arguments are searched for tensors (args -> codec state -> rotation -> array is 4).
_MAX_DEPTH = 6


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist before torch is imported
    return torch is not None and isinstance(x, torch.Tensor)


def _is_backend_array(x: Any) -> bool:
    """A NumPy array or scalar, or a CuPy array: what a kernel returns."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, (np.ndarray, np.number, np.bool_)):
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def route(device: Device) -> str | None:
    """The kernel backend for tensors on ``device``: ``"numpy"`` (CPU), ``"cupy"`` (CUDA) or None."""
    kind = getattr(device, "type", device)
    if kind == "cpu":
        return "numpy"
    if kind == "cuda":
        return "cupy"
    return None


def _first_tensor(obj: Any, depth: int = 0) -> Array | None:
    """The first tensor in ``obj`` (arguments, tuples, dataclasses), or None."""
    if _is_tensor(obj):
        return obj
    if depth > _MAX_DEPTH:
        return None
    for item in _children(obj):
        t = _first_tensor(item, depth + 1)
        if t is not None:
            return t
    return None


def _children(obj: Any) -> Iterable[Any]:
    if isinstance(obj, (tuple, list)):
        return obj
    if isinstance(obj, dict):
        return obj.values()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return ()


def _convert(obj: Any, leaf: Callable[[Array], Array], is_leaf: Callable[[Any], bool], depth: int = 0) -> Any:
    """``obj`` with every leaf ``x`` (``is_leaf(x)``) replaced by ``leaf(x)``; containers rebuilt only when changed."""
    if is_leaf(obj):
        return leaf(obj)
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, (tuple, list)):
        items = [_convert(item, leaf, is_leaf, depth + 1) for item in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, dict):
        out = {key: _convert(val, leaf, is_leaf, depth + 1) for key, val in obj.items()}
        return obj if all(out[key] is obj[key] for key in obj) else out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            val = getattr(obj, f.name)
            new = _convert(val, leaf, is_leaf, depth + 1)
            if new is not val:
                if not f.init:
                    raise TypeError(
                        f"{type(obj).__name__}.{f.name} holds an array but is not an __init__ field; "
                        "the torch bridge cannot rebuild it"
                    )
                changed[f.name] = new
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj


def _to_numpy(t: Array) -> Array:

    return np.from_dlpack(t)


def _to_cupy(t: Array) -> Array:
    import cupy

    return cupy.from_dlpack(t)


def _to_torch(a: Array) -> Array:
    import torch

    if type(a).__module__.startswith("numpy"):
        a = np.asarray(a)  # a NumPy scalar becomes a 0-d array
        if not a.flags.writeable:
            a = a.copy()  # a tensor would share read-only memory as if it were writable
    return torch.from_dlpack(a)


@contextlib.contextmanager
def _cuda_context(t: Array) -> Iterator[None]:
    """CuPy's current device and stream set to ``t``'s device and PyTorch's current stream there."""
    import cupy
    import torch

    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream):
        yield


def _run(
    kernel: Callable[..., Any], backend: str, args: tuple[Any, ...], kwargs: dict[str, Any], first: Array | None
) -> Any:
    to = _to_numpy if backend == "numpy" else _to_cupy
    cargs = _convert(args, to, _is_tensor)
    ckwargs = _convert(kwargs, to, _is_tensor)
    if backend == "cupy":
        with _cuda_context(first):
            out = kernel(*cargs, **ckwargs)
    else:
        out = kernel(*cargs, **ckwargs)
    return _convert(out, _to_torch, _is_backend_array)


def bridged(kernel: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``kernel`` (the ``backend`` kernel of an op) as a function of tensors.

    Parameters
    ----------
    kernel : callable
        A NumPy (``backend="numpy"``) or CuPy (``"cupy"``) kernel with its reference's signature.
    backend : {"numpy", "cupy"}

    Returns
    -------
    callable
        Same signature; tensor arguments (also inside tuples, lists, dicts and dataclasses)
        are passed to ``kernel`` as DLPack views, array results come back as tensors on the
        inputs' device, sharing the kernel's output memory.
    """
    if backend not in ("numpy", "cupy"):
        raise ValueError(f"backend must be 'numpy' or 'cupy', received {backend!r}")

    def run(*args: Any, **kwargs: Any) -> Any:
        return _run(kernel, backend, args, kwargs, _first_tensor((args, kwargs)))

    run.__wrapped__ = kernel  # type: ignore[attr-defined]  # what inspect.signature follows
    run.__name__ = getattr(kernel, "__name__", "kernel")
    run.__doc__ = getattr(kernel, "__doc__", None)
    return run


def dispatching(
    resolve: Callable[[str], Callable[..., Any] | None], reference: Callable[..., Any]
) -> Callable[..., Any]:
    """A function of tensors that picks the kernel by the device of its first tensor argument.

    ``resolve(backend)`` returns the kernel for ``"numpy"`` or ``"cupy"`` (or None). Where
    there is none for the device, ``reference`` runs. Used when
    the caller of :func:`arraykv.ops.registry.lookup` gave no device; callers that know it get
    a kernel for that device alone (:func:`bridged`), which matters for ops whose kernels take
    their arguments in other units than the reference (``int_decode_attention``).
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        first = _first_tensor((args, kwargs))
        backend = route(first.device) if first is not None else None
        kernel = resolve(backend) if backend is not None else None
        if kernel is None or backend is None:
            return reference(*args, **kwargs)
        return _run(kernel, backend, args, kwargs, first)

    return run
