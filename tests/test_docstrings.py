"""numpydoc validation of the public API's docstrings.

Every function and class named in the ``__all__`` of :mod:`arraykv`, :mod:`arraykv.store` and
:mod:`arraykv.eval` must pass numpydoc's checks of what a docstring documents:

* GL08: the object has a docstring;
* PR01: every parameter is documented; PR02: no documented parameter is unknown; PR03: they
  are documented in the signature's order; PR04: each has a type; PR07: each has a description;
* RT01: a function that returns a value has a Returns section; RT03: each return value has a
  description.

A class is checked against its constructor's parameters (a dataclass lists its fields under
Parameters). Names in ``__all__`` that are not functions or classes (constants, the
``DecodeOutput`` type alias, ``__version__``) are not checked.

Style-only checks are not enforced: SS05 (summary starting with an infinitive verb), SS06
(one-line summary), ES01 (extended summary), SA01 (See Also), EX01 (Examples), GL02 (opening
quotes' line), nor any other numpydoc check not listed above.

The test is skipped when numpydoc is not installed (the ``test`` extra installs it).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

validate = pytest.importorskip(
    "numpydoc.validate", reason="numpydoc is not installed (pip install arraykv[test])"
).validate

#: The numpydoc checks enforced (see the module docstring).
CHECKS = frozenset({"GL08", "PR01", "PR02", "PR03", "PR04", "PR07", "RT01", "RT03"})

PUBLIC_MODULES = ("arraykv", "arraykv.store", "arraykv.eval")


def _errors(qualified_name: str) -> list:
    """``"<name>: <code> <message>"`` for each enforced check ``qualified_name`` fails."""
    return [f"{qualified_name}: {code} {msg}" for code, msg in validate(qualified_name)["errors"] if code in CHECKS]


def _exported(module_name: str) -> list:
    """The functions and classes in ``module_name.__all__``, as ``module.qualname`` strings."""
    module = importlib.import_module(module_name)
    names = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            names.append(f"{obj.__module__}.{obj.__qualname__}")
    return names


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_exported_functions_and_classes(module_name):
    names = _exported(module_name)
    assert names, f"{module_name}.__all__ names no function or class"
    errors = [e for name in names for e in _errors(name)]
    assert not errors, f"{len(errors)} numpydoc errors in {module_name}:\n" + "\n".join(errors)
