"""The on-screen word about a long compilation: said when a compile outlasts the threshold, not otherwise."""

from __future__ import annotations

import io

import numba
import numpy as np

from arraykv.compile_notice import compile_notice  # noqa: E402


def _fresh_kernel():
    @numba.njit  # a new dispatcher each call: compiled on first use, never from the disk cache
    def total(x):
        s = 0.0
        for i in range(x.shape[0]):
            s += x[i] * x[i]
        return s

    return total


def test_a_compile_longer_than_the_threshold_is_announced_with_its_name_and_time():
    out = io.StringIO()
    with compile_notice(after=0.0, stream=out):
        assert _fresh_kernel()(np.ones(4)) == 4.0
    text = out.getvalue()
    assert "arraykv: compiling the CPU kernel" in text and "total(array(float64, 1d, C))" in text
    assert "arraykv: compiled in" in text


def test_quick_compiles_and_calls_outside_the_block_say_nothing():
    out = io.StringIO()
    with compile_notice(after=600.0, stream=out):
        _fresh_kernel()(np.ones(4))
    _fresh_kernel()(np.ones(4))  # no listener any more
    assert out.getvalue() == ""
