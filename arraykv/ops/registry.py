"""The one registry of accelerated ops: for each op, its array-API reference and its kernels.

An op is registered with the ``"module:attr"`` path of its reference and of a kernel per
backend (``"numpy"``: Numba, ``"cupy"``: CUDA through CuPy). Kernels take exactly the
arguments of the reference (``tests/ops/test_kernel_signatures.py`` checks it) and are imported
the first time they are asked for, so importing :mod:`arraykv` never imports Numba or CuPy.

PyTorch
-------
``torch`` is not a backend of its own: for the torch namespace :func:`lookup` returns the
NumPy kernel (CPU tensors) or the CuPy kernel (CUDA tensors) wrapped by
:mod:`arraykv.ops.bridge`, which passes tensors to it and takes its results back through
DLPack, without copies.

ImportError policy
------------------
CuPy is optional: a CuPy kernel module raises ImportError when CuPy is not installed;
:func:`lookup` then returns None and the op runs its reference, silently (arrays of a library
without kernels take that path too). Numba is a dependency of the package, not an option: any
other ImportError while importing a kernel (Numba or llvmlite missing or broken, a missing
module of the package itself) is a defect: :func:`lookup` emits one :class:`RuntimeWarning`
per kernel naming it and the error, and the op falls back to its reference, so results stay
correct while the warning says what is broken. Errors other than ImportError propagate.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import _compat
from .._types import Device, Namespace

__all__ = [
    "register_op",
    "lookup",
    "reference",
    "implementation",
    "op_names",
    "kernel_target",
    "kernels_enabled",
    "set_kernels_enabled",
    "BACKENDS",
    "OPTIONAL_MODULES",
]

#: Backends a kernel may be registered for, by the namespace it serves.
BACKENDS = ("numpy", "cupy")
#: Top-level modules whose absence means "no accelerator here" (silent fallback).
OPTIONAL_MODULES = frozenset({"cupy", "cupy_backends", "cupyx", "fastrlock"})


@dataclass
class _Op:
    reference: str
    targets: dict[str, str] = field(default_factory=dict)


_OPS: dict[str, _Op] = {}
_RESOLVED: dict[tuple[str | None, ...], Callable[..., Any] | None] = {}
_LOCK = threading.Lock()
_state = threading.local()
_GLOBAL_ENABLED = os.environ.get("ARRAYKV_DISABLE_KERNELS", "") in ("", "0")


def register_op(name: str, reference: str, **targets: str) -> None:
    """Register op ``name``: its reference and kernels, each a ``"module:attr"`` path.

    Parameters
    ----------
    name : str
    reference : str
        The array-API function that defines the op (its signature is the op's).
    **targets : str
        ``numpy=...`` and/or ``cupy=...``: kernels with the same signature.
    """
    bad = set(targets) - set(BACKENDS)
    if bad:
        raise ValueError(f"kernel backends must be among {BACKENDS}, received {sorted(bad)}")
    with _LOCK:
        op = _OPS.setdefault(name, _Op(reference))
        op.reference = reference
        op.targets.update(targets)
        for key in [k for k in _RESOLVED if k[0] == name]:
            del _RESOLVED[key]


def op_names() -> list[str]:
    """Names of the registered ops, sorted."""
    return sorted(_OPS)


def kernel_target(name: str, backend: str) -> str | None:
    """The ``"module:attr"`` path of ``name``'s kernel for ``backend``, or None."""
    return _op(name).targets.get(backend)


def kernels_enabled() -> bool:
    """Whether accelerated kernels are used (per thread; ``ARRAYKV_DISABLE_KERNELS=1`` turns them off)."""
    return bool(getattr(_state, "enabled", _GLOBAL_ENABLED))


@contextlib.contextmanager
def set_kernels_enabled(enabled: bool) -> Iterator[None]:
    """Context manager that turns accelerated kernels on or off in this thread."""
    old = kernels_enabled()
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = old


def _op(name: str) -> _Op:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"no op named {name!r}; registered: {', '.join(op_names())}") from None


def _load(path: str) -> Callable[..., Any]:
    mod_name, attr = path.split(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(mod_name), attr)
    return fn


def _optional_missing(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it was raised from) says an optional accelerator module is absent."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] in OPTIONAL_MODULES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def reference(name: str) -> Callable[..., Any]:
    """The array-API reference of op ``name``."""
    key = (name, "reference")
    fn = _RESOLVED.get(key)
    if fn is None:
        fn = _load(_op(name).reference)
        with _LOCK:
            _RESOLVED[key] = fn
    return fn


#: :func:`_backend` of the namespaces met, by id: ``(namespace, backend)`` (the entry keeps the namespace).
_BACKENDS: dict[int, tuple[Namespace, str | None]] = {}


def _backend(xp: Namespace) -> str | None:
    hit = _BACKENDS.get(id(xp))
    if hit is not None and hit[0] is xp:
        return hit[1]
    backend = None
    if _compat.is_numpy(xp):
        backend = "numpy"
    elif _compat.is_cupy(xp):
        backend = "cupy"
    elif _compat.is_torch(xp):
        backend = "torch"
    if len(_BACKENDS) < 64:
        _BACKENDS[id(xp)] = (xp, backend)
    return backend


def _resolve(name: str, backend: str) -> Callable[..., Any] | None:
    """The kernel of op ``name`` for ``backend`` ("numpy" or "cupy"), imported once, or None."""
    key = (name, backend)
    if key in _RESOLVED:
        return _RESOLVED[key]
    target = _op(name).targets.get(backend)
    fn: Callable[..., Any] | None = None
    if target is not None:
        try:
            fn = _load(target)
        except ImportError as exc:
            if not _optional_missing(exc):
                warnings.warn(
                    f"arraykv kernel {name!r} ({target}) could not be imported and the array-API "
                    f"reference is used instead: {type(exc).__name__}: {exc}",
                    RuntimeWarning,
                    stacklevel=3,
                )
    with _LOCK:
        _RESOLVED[key] = fn
    return fn


def _resolve_torch(name: str, device: Device) -> Callable[..., Any] | None:
    """A kernel of op ``name`` that takes and returns torch tensors (:mod:`arraykv.ops.bridge`), or None.

    With a ``device``, the kernel of that device's backend (NumPy's for CPU tensors, CuPy's for
    CUDA tensors) behind DLPack, or None where that backend has none. Without one, a function
    that picks the backend by the device of its first tensor at each call and runs the reference
    where that backend has no kernel; None when the op has no kernel for any backend.
    """
    from . import bridge

    backend = None if device is None else bridge.route(device)
    if device is not None and backend is None:
        return None  # a device no kernel serves (mps, meta, ...)
    key = (name, "torch", backend)
    if key in _RESOLVED:
        return _RESOLVED[key]
    if backend is None:
        op = _op(name)
        fn = (
            bridge.dispatching(lambda b: _resolve(name, b), reference(name))
            if any(b in op.targets for b in BACKENDS)
            else None
        )
    else:
        kernel = _resolve(name, backend)
        fn = None if kernel is None else bridge.bridged(kernel, backend)
    with _LOCK:
        _RESOLVED[key] = fn
    return fn


def lookup(name: str, xp: Namespace, device: Device = None) -> Callable[..., Any] | None:
    """The kernel of op ``name`` for namespace ``xp``, or None (none registered or importable, or disabled).

    Parameters
    ----------
    name : str
        A registered op.
    xp : namespace
        NumPy gets the Numba kernel, CuPy the CUDA kernel. PyTorch gets one of those behind
        DLPack (:mod:`arraykv.ops.bridge`): the Numba kernel for CPU tensors, the CUDA kernel
        for CUDA tensors, chosen by ``device``.
    device : optional
        The arguments' device; only PyTorch needs it, since one torch namespace serves both
        CPU and CUDA. Without it, a torch kernel picks its backend at each call and runs the
        reference where the device has no kernel.
    """
    if not kernels_enabled():
        return None
    backend = _backend(xp)
    if backend is None:
        return None
    if backend == "torch":
        return _resolve_torch(name, device)
    return _resolve(name, backend)


def implementation(name: str, xp: Namespace, device: Device = None) -> Callable[..., Any]:
    """What op ``name`` runs for namespace ``xp`` (and ``device``): its kernel (:func:`lookup`) or its reference."""
    return lookup(name, xp, device) or reference(name)


_Q, _A, _N, _C = "arraykv.quant", "arraykv.attention", "arraykv.ops.numba", "arraykv.ops.cuda"
register_op(
    "pack_bits", f"{_Q}.bitpack:pack_bits_reference", numpy=f"{_N}.bitpack:pack_bits", cupy=f"{_C}.bitpack:pack_bits"
)
register_op(
    "unpack_bits",
    f"{_Q}.bitpack:unpack_bits_reference",
    numpy=f"{_N}.bitpack:unpack_bits",
    cupy=f"{_C}.bitpack:unpack_bits",
)
register_op(
    "polar_encode",
    f"{_Q}.polar:polar_encode_reference",
    numpy=f"{_N}.polar.codec:polar_encode",
    cupy=f"{_C}.polar:polar_encode",
)
register_op(
    "polar_encode_tokens",
    f"{_Q}.polar_tokens:polar_encode_tokens_reference",
    numpy=f"{_N}.polar.tokens:polar_encode_tokens",
)
register_op(
    "polar_store_token", f"{_Q}.polar_store:polar_store_token_reference", numpy=f"{_N}.polar.store:polar_store_token"
)
register_op(
    "polar_decode",
    f"{_Q}.polar:polar_decode_reference",
    numpy=f"{_N}.polar.codec:polar_decode",
    cupy=f"{_C}.polar:polar_decode",
)
register_op("intq_group_minmax", f"{_Q}.intq:group_minmax_reference", numpy=f"{_N}.intq:group_minmax")
register_op("intq_quantize_pack", f"{_Q}.intq:quantize_pack_reference", numpy=f"{_N}.intq:quantize_pack")
register_op("intq_dequantize", f"{_Q}.intq:dequantize_reference", numpy=f"{_N}.intq:dequantize")
register_op("split_outliers", f"{_Q}.outliers:split_outliers_reference", numpy=f"{_N}.outliers:split_outliers")
register_op("vq_assign", f"{_Q}.vq:assign_reference", numpy=f"{_N}.vq:assign")
register_op("vq_update", f"{_Q}.vq:update_reference", numpy=f"{_N}.vq:update")
register_op("vq_encode", f"{_Q}.vq:vq_encode_reference", numpy=f"{_N}.vq:encode")
register_op("vq_decode", f"{_Q}.vq:vq_decode_reference", numpy=f"{_N}.vq:decode")
register_op(
    "polar_decode_attention",
    f"{_A}.polar_fused:polar_decode_attention_reference",
    numpy=f"{_N}.polar.fused:polar_decode_attention",
    cupy=f"{_C}.polar:polar_decode_attention",
)
register_op(
    "int_decode_attention",
    f"{_A}.int_fused:int_decode_attention_reference",
    numpy=f"{_N}.int_fused:int_decode_attention",
)
register_op(
    "vq_decode_attention", f"{_A}.vq_fused:vq_decode_attention_reference", numpy=f"{_N}.vq_fused:vq_decode_attention"
)
register_op(
    "lowrank_decode_attention",
    f"{_A}.lowrank_fused:lowrank_decode_attention",
    numpy=f"{_N}.lowrank_fused:lowrank_decode_attention",
)
