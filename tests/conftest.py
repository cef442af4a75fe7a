"""Shared fixtures: the array namespaces every agnostic test runs on."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest


def _cupy_available() -> bool:
    try:
        cp = importlib.import_module("cupy")
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


_NAMESPACES = ["numpy", "array_api_strict"]
if _cupy_available():
    _NAMESPACES.append("cupy")


@pytest.fixture(params=_NAMESPACES)
def xp(request):
    """An array namespace: NumPy, array_api_strict, and CuPy when a GPU is present."""
    if request.param == "numpy":
        import array_api_compat.numpy as xnp

        return xnp
    if request.param == "cupy":
        import array_api_compat.cupy as xcp

        return xcp
    return importlib.import_module(request.param)


def asarray(xp, a, dtype=None):
    """Move NumPy data ``a`` into namespace ``xp`` (keeping its dtype unless told)."""
    a = np.asarray(a)
    dt = getattr(xp, str(a.dtype if dtype is None else np.dtype(dtype)))
    return xp.asarray(a, dtype=dt)


def to_np(x):
    from arraykv._compat import to_numpy

    return np.asarray(to_numpy(x))


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def parallel_threshold():
    """``parallel_threshold(n)``: the CPU kernels run serially below ``n`` values until the test ends."""
    import contextlib

    from arraykv.ops.numba.threads import serial_below

    with contextlib.ExitStack() as stack:
        yield lambda n: stack.enter_context(serial_below(n))


# The kernels' parallel paths are under test even where NumPy's OpenBLAS runs several threads
# (where the library itself runs them serially: arraykv.ops.numba.threads, "beside a threaded BLAS").
os.environ.setdefault("ARRAYKV_BESIDE_BLAS", "parallel")

import arraykv  # noqa: E402

#: The registered cache methods before any test module registers a test double of its own
#: (conftest is loaded first): what the contract tests parametrize over, whatever the order of
#: collection.
BUILTIN_METHODS = tuple(arraykv.available_methods())
