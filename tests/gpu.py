"""Helpers for tests that need a CUDA GPU through CuPy (they skip cleanly without one)."""

import importlib

import pytest


def gpu_available() -> bool:
    try:
        cp = importlib.import_module("cupy")
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
