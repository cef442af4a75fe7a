"""numpydoc validation of the public API's docstrings.

Every function and class named in the ``__all__`` of :mod:`arraykv`, :mod:`arraykv.store` and
:mod:`arraykv.eval`, and every public method of the classes these modules export and of the
cache classes :func:`arraykv.make_cache` builds (checked on the class that defines it, their
base classes in arraykv included), must pass numpydoc's checks of what a docstring documents:

* GL08: the object has a docstring;
* PR01: every parameter is documented; PR02: no documented parameter is unknown; PR03: they
  are documented in the signature's order; PR04: each has a type; PR07: each has a description;
* RT01: a function that returns a value has a Returns section; RT03: each return value has a
  description.

A class is checked against its constructor's parameters (a dataclass lists its fields under
Parameters). Names in ``__all__`` that are not functions or classes (constants, the
``DecodeOutput`` type alias, ``__version__``) are not checked, nor are properties, private
methods, or classes registered with :func:`arraykv.register_method` from outside arraykv.

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


def _cache_classes() -> list:
    """The classes :func:`arraykv.make_cache` builds by name (those defined in arraykv)."""
    import arraykv
    from arraykv.caches.registry import _factory  # imports a method registered by path

    out = []
    for method in arraykv.available_methods(generic=True):
        factory = _factory(method)
        if inspect.isclass(factory) and factory.__module__.split(".")[0] == "arraykv":
            out.append(factory)
    return out


def _public_methods(module_name: str) -> list:
    """``module.Class.method`` of each public method defined on the classes ``module_name``
    exports (for :mod:`arraykv`, also the cache classes) and on their bases in arraykv; each
    method once, on the class that defines it."""
    module = importlib.import_module(module_name)
    roots = [obj for obj in (getattr(module, n) for n in module.__all__) if inspect.isclass(obj)]
    if module_name == "arraykv":
        roots += _cache_classes()
    classes = {}
    for root in roots:
        for cls in root.__mro__:
            if cls.__module__.split(".")[0] == "arraykv":
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    names = []
    for qualified, cls in sorted(classes.items()):
        for name, attr in vars(cls).items():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if not name.startswith("_") and inspect.isfunction(attr):
                names.append(f"{qualified}.{name}")
    return names


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_methods_of_the_exported_classes(module_name):
    names = _public_methods(module_name)
    assert names, f"the classes of {module_name}.__all__ define no public method"
    if module_name == "arraykv":
        assert "arraykv.caches.base.LayeredCache.prefill" in names, "the caches' base class was not reached"
    errors = [e for name in names for e in _errors(name)]
    assert not errors, f"{len(errors)} numpydoc errors in the methods of {module_name}'s classes:\n" + "\n".join(errors)
