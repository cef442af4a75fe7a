"""Saving and loading caches: prefix caching, moving a cache between processes or devices.

:func:`save_cache` is :meth:`arraykv.caches.LayeredCache.save`; :func:`load_cache` reads a
file (format and checks: :mod:`arraykv.storage.cache_file`), rebuilds the cache from the
configuration it holds (:func:`arraykv.make_cache`: same method, options, seed and rotation)
and gives it the saved state through the public
:meth:`~arraykv.caches.LayeredCache.restore`. A truncated, corrupted, hostile or
wrong-version file raises :class:`CacheFileError` before anything of its size is built, and
never returns a wrong cache.

The SHA-256 trailer only catches accidents: a hostile file carries a valid one. So nothing
in a file is trusted: the reader bounds the declared geometry (``head_dim``,
``num_kv_heads``, ``max_tokens``, batch, lengths) before the cache is constructed, and
``restore`` checks every layer's arrays against what the cache can hold (dtypes, shapes and
packed widths against the geometry, token counts against ``length``, indices and exponents
in range, floats finite and bounded; :mod:`arraykv.caches.layout`) before any layer is
built, so the kernels never read metadata that was not checked, and refuses state that would
load and then fail every call: means, windows, bases and exact tokens that leave no float16
room for the next token of ordinary magnitude (:mod:`arraykv.caches.restore_checks`). A file
either loads a cache that decodes, or raises :class:`CacheFileError` naming the layer and array.
"""

from __future__ import annotations

import os

import numpy as np

from . import _compat
from ._types import Namespace
from .caches.base import LayeredCache
from .caches.hybrid import HybridCache
from .caches.registry import available_methods, make_cache
from .storage.cache_file import FORMAT_VERSION, CacheFileError, read_cache_file

__all__ = ["save_cache", "load_cache", "CacheFileError", "FORMAT_VERSION"]


def save_cache(cache: LayeredCache | HybridCache, path: str | os.PathLike) -> int:
    """Write ``cache`` to ``path``; return the file's size in bytes (see :meth:`LayeredCache.save`).

    Parameters
    ----------
    cache : LayeredCache
        Any cache built on :class:`arraykv.caches.LayeredCache` (every built-in method).
    path : str or path-like
        Target file; replaced atomically.
    """
    if not isinstance(cache, (LayeredCache, HybridCache)):
        raise TypeError(
            f"cache must be a LayeredCache (any built-in method) or a HybridCache, received {type(cache).__name__}"
        )
    return cache.save(path)


def load_cache(path: str | os.PathLike, *, xp: Namespace | None = None) -> LayeredCache | HybridCache:
    """Read a cache written by :func:`save_cache`.

    Parameters
    ----------
    path : str or path-like
        The cache file.
    xp : namespace, optional
        Array namespace for the loaded state (for example ``cupy`` to move a cache to the GPU).
        Default: NumPy.

    Returns
    -------
    LayeredCache or HybridCache
        A cache of the saved method and options whose state is bit-identical to the saved one.

    Raises
    ------
    CacheFileError
        Truncated or corrupted file, unknown version or method, or content that does not fit
        the method.
    FileNotFoundError
        No file at ``path``.
    """
    config, layers = read_cache_file(path)
    method = config.get("method")
    if not isinstance(method, str) or method not in available_methods(generic=True):
        raise CacheFileError(f"{path} names method {method!r}, which is not registered")
    if xp is None:
        xp = _compat.namespace(np.empty(0))
    try:
        cache = make_cache(**config)
    except (TypeError, ValueError) as exc:
        raise CacheFileError(f"{path} holds a configuration that builds no cache: {exc}") from None
    if not isinstance(cache, (LayeredCache, HybridCache)):
        raise CacheFileError(f"{path}: method {method!r} does not build a cache that can be restored")
    try:
        cache.restore(layers, xp=xp)  # restore moves the host arrays to xp
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CacheFileError(f"{path} does not describe a valid {method!r} cache: {exc}") from None
    return cache
