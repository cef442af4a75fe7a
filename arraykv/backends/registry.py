"""Look up an accelerated kernel by name for an array namespace."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import Any, Callable

from .. import _compat

__all__ = ["lookup", "kernels_enabled", "set_kernels_enabled", "register_kernel"]

# name -> {"numpy": "module:attr", "cupy": "module:attr"}
_KERNELS: dict[str, dict[str, str]] = {}
_RESOLVED: dict[tuple, Any] = {}
_LOCK = threading.Lock()
_state = threading.local()
_GLOBAL_ENABLED = os.environ.get("ARRAYKV_DISABLE_KERNELS", "") in ("", "0")


def register_kernel(name: str, backend: str, target: str) -> None:
    """Declare that ``target`` (``"module:attr"``, imported lazily) implements ``name`` on ``backend``.

    ``backend`` is ``"numpy"`` or ``"cupy"``. The target module may raise ImportError (Numba or
    CuPy missing); :func:`lookup` then returns None.
    """
    if backend not in ("numpy", "cupy"):
        raise ValueError(f"backend must be 'numpy' or 'cupy', received {backend!r}")
    with _LOCK:
        _KERNELS.setdefault(name, {})[backend] = target


def kernels_enabled() -> bool:
    """Whether accelerated kernels are used (per thread; ``ARRAYKV_DISABLE_KERNELS=1`` turns them off)."""
    return getattr(_state, "enabled", _GLOBAL_ENABLED)


@contextlib.contextmanager
def set_kernels_enabled(enabled: bool):
    """Context manager that turns accelerated kernels on or off in this thread."""
    old = kernels_enabled()
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = old


def lookup(name: str, xp: Any) -> Callable | None:
    """The accelerated ``name`` for namespace ``xp``, or None when unavailable or disabled."""
    if not kernels_enabled():
        return None
    if _compat.is_numpy(xp):
        backend = "numpy"
    elif _compat.is_cupy(xp):
        backend = "cupy"
    else:
        return None
    key = (name, backend)
    if key in _RESOLVED:
        return _RESOLVED[key]
    target = _KERNELS.get(name, {}).get(backend)
    fn = None
    if target is not None:
        mod_name, attr = target.split(":")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except ImportError:
            fn = None
    with _LOCK:
        _RESOLVED[key] = fn
    return fn


# Built-in kernels (imported only when first looked up).
register_kernel("pack_bits", "numpy", "arraykv.backends._numba_bitpack:pack_bits")
register_kernel("unpack_bits", "numpy", "arraykv.backends._numba_bitpack:unpack_bits")
register_kernel("pack_bits", "cupy", "arraykv.backends._cuda_bitpack:pack_bits")
register_kernel("unpack_bits", "cupy", "arraykv.backends._cuda_bitpack:unpack_bits")
register_kernel("intq_group_minmax", "numpy", "arraykv.backends._numba_intq:group_minmax")
register_kernel("intq_quantize_pack", "numpy", "arraykv.backends._numba_intq:quantize_pack")
register_kernel("intq_dequantize", "numpy", "arraykv.backends._numba_intq:dequantize")
register_kernel("split_outliers", "numpy", "arraykv.backends._numba_outliers:split_outliers")
register_kernel("pq_assign", "numpy", "arraykv.backends._numba_pq:assign")
register_kernel("pq_update", "numpy", "arraykv.backends._numba_pq:update")
register_kernel("pq_encode", "numpy", "arraykv.backends._numba_pq:encode")
register_kernel("pq_decode", "numpy", "arraykv.backends._numba_pq:decode")
register_kernel("polar_encode", "numpy", "arraykv.backends._numba_polar:polar_encode")
register_kernel("polar_decode", "numpy", "arraykv.backends._numba_polar:polar_decode")
register_kernel("polar_decode_attention", "numpy", "arraykv.backends._numba_fused:polar_decode_attention")
register_kernel("int_decode_attention", "numpy", "arraykv.backends._numba_int_fused:int_decode_attention")
register_kernel("pq_decode_attention", "numpy", "arraykv.backends._numba_pq_fused:pq_decode_attention")
register_kernel("polar_encode", "cupy", "arraykv.backends._cuda_polar:polar_encode")
register_kernel("polar_decode", "cupy", "arraykv.backends._cuda_polar:polar_decode")
register_kernel("polar_decode_attention", "cupy", "arraykv.backends._cuda_polar:polar_decode_attention")
