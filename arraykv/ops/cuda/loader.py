"""The one loader of CUDA kernels: ``kernels/*.cu`` compiled by ``cupy.RawModule``.

Sources are read from the installed package (:mod:`arraykv.ops.kernel_files`), a
``#line 1 "<path>"`` directive is prepended so compiler errors point at the ``.cu`` file, and
templates are instantiated by name expression (``pack_bits<3>``). Modules are memoised per
(source, name expressions, options) for the life of the process; CuPy also keeps compiled
binaries on disk between processes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..._types import Namespace
from ..kernel_files import kernel_source

__all__ = ["require_cupy", "load_module", "get_kernel", "DEFAULT_OPTIONS"]

DEFAULT_OPTIONS = ("-std=c++17",)
# the compiled CuPy modules and kernels, by what made them (CuPy has no type information)
_MODULES: dict[tuple[str, tuple[str, ...], tuple[str, ...]], Any] = {}
_FUNCTIONS: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], Any] = {}
_LOCK = threading.Lock()


def require_cupy() -> Namespace:
    """Import CuPy or raise an ImportError that says how to install it."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError('the GPU kernels need CuPy: pip install "arraykv[cuda]" (cupy-cuda12x)') from exc
    return cupy


def load_module(source: str, name_expressions: Iterable[str], options: Iterable[str] = DEFAULT_OPTIONS) -> Any:
    """Compile (once) and return the ``cupy.RawModule`` of ``kernels/<source>``.

    Parameters
    ----------
    source : str
        File name under ``kernels/``, for example ``"bitpack.cu"``.
    name_expressions : iterable of str
        Every kernel (template instantiation) the caller will fetch from this module.
    options : iterable of str
        NVRTC options.
    """
    names = tuple(sorted(set(name_expressions)))
    opts = tuple(options)
    key = (source, names, opts)
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    cupy = require_cupy()
    text, path = kernel_source(source)
    code = f'#line 1 "{path}"\n' + text
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is None:
            mod = cupy.RawModule(code=code, options=opts, name_expressions=names)
            mod.compile()
            _MODULES[key] = mod
    return mod


def get_kernel(
    source: str, name: str, family: Iterable[str] | None = None, options: Iterable[str] = DEFAULT_OPTIONS
) -> Any:
    """The kernel ``name`` of ``kernels/<source>``; ``family`` lists sibling instantiations
    compiled in the same module (so one compilation serves them all).

    The function objects are memoised too: a decode step fetches its kernels on every call.
    """
    fam = tuple(family) if family is not None else ()
    opts = tuple(options)
    key = (source, name, fam, opts)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = load_module(source, set(fam) | {name}, opts).get_function(name)
        _FUNCTIONS[key] = fn
    return fn
