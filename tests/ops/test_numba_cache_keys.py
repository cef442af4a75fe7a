"""Numba's disk cache keys compiled code by a function's file, name and first line, not by its
options: two cached dispatchers of one Python function (a serial and a ``parallel=True``
variant) would load each other's code, whichever was compiled first."""

from __future__ import annotations

import importlib
import pkgutil

from numba.core.caching import NullCache  # noqa: E402
from numba.core.registry import CPUDispatcher  # noqa: E402

import arraykv.ops.numba as kernels  # noqa: E402


def _cached_dispatchers():
    for info in pkgutil.walk_packages(kernels.__path__, f"{kernels.__name__}."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and not isinstance(obj._cache, NullCache):
                yield f"{mod.__name__}.{name}", obj


def test_every_cached_kernel_has_a_cache_key_of_its_own():
    seen, objects = {}, {}
    for name, disp in _cached_dispatchers():
        if id(disp) in objects:  # one dispatcher imported into another module
            continue
        objects[id(disp)] = disp
        code = disp.py_func.__code__
        key = (code.co_filename, disp.py_func.__qualname__, code.co_firstlineno)
        assert key not in seen, f"{name} and {seen[key]} share Numba's cache entry {key}"
        seen[key] = name
    assert len(seen) > 10


def test_parallel_polar_encode_is_the_parallel_code():
    from arraykv.ops.numba.polar import codec

    assert codec.encode_par.targetoptions.get("parallel") and not codec.encode_ser.targetoptions.get("parallel")
    assert codec.encode_par.py_func.__qualname__ != codec.encode_ser.py_func.__qualname__
