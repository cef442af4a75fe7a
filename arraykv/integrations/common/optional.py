"""Optional dependencies: import one, or say which extra installs it; a package's lazy re-exports."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["lazy_exports", "require"]


def require(module: str, extra: str = "model") -> types.ModuleType:
    """Import an optional dependency or raise an ImportError saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f'{module} is needed for this feature; install it with: python -m pip install "arraykv[{extra}]"'
        ) from exc


def lazy_exports(package: str, exports: dict) -> tuple:
    """A package's ``__getattr__`` and ``__dir__`` that import each exported name's module on first use.

    A package re-exports its modules' public names this way so that importing it imports none of
    them (nor torch or onnxruntime, which some of them import at module level).

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    exports : dict of str to str
        Exported name to the module (relative to ``package``) that defines it.

    Returns
    -------
    (__getattr__, __dir__) : tuple of callables
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
