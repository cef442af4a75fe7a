"""Every registered op: its kernels take exactly the parameters of its array-API reference."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest

from arraykv import ops
from arraykv.ops import registry


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _target(path):
    mod, attr = path.split(":")
    return getattr(importlib.import_module(mod), attr)


@pytest.mark.parametrize("name", registry.op_names())
@pytest.mark.parametrize("backend", registry.BACKENDS)
def test_kernel_signature_is_the_reference_signature(name, backend):
    path = registry.kernel_target(name, backend)
    if path is None:
        pytest.skip(f"no {backend} kernel for {name}")
    try:
        kernel = _target(path)
    except ImportError as exc:
        pytest.skip(f"{path} not importable here: {exc}")
    assert _params(kernel) == _params(registry.reference(name)), path


@pytest.mark.parametrize("name", registry.op_names())
def test_ops_entry_has_the_reference_signature(name):
    assert _params(getattr(ops, name)) == _params(registry.reference(name))


def test_every_op_has_a_public_entry():
    assert set(registry.op_names()) <= set(ops.__all__)


def test_missing_accelerator_falls_back_silently(monkeypatch):
    np = pytest.importorskip("numpy")
    registry.register_op(
        "_test_missing", "arraykv.quant.bitpack:pack_bits_reference", numpy="arraykv._no_such_module_for_tests:f"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # a module of the package that does not exist is a defect: warned about once
            with pytest.warns(RuntimeWarning, match="_test_missing"):
                assert registry.lookup("_test_missing", np) is None
            assert registry.lookup("_test_missing", np) is None  # cached: no second warning
            assert registry.implementation("_test_missing", np) is registry.reference("_test_missing")
    finally:
        registry._OPS.pop("_test_missing", None)
        registry._RESOLVED.pop(("_test_missing", "numpy"), None)


def test_optional_module_missing_is_silent():
    exc = ModuleNotFoundError("No module named 'cupy'", name="cupy")
    assert registry._optional_missing(exc)
    required = ModuleNotFoundError("No module named 'numba'", name="numba")  # a dependency: warned about
    assert not registry._optional_missing(required)
    bug = ModuleNotFoundError("No module named 'arraykv.quant.nothing'", name="arraykv.quant.nothing")
    assert not registry._optional_missing(bug)
