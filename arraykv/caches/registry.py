"""The cache factory: names to cache constructors."""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["make_cache", "available_methods", "register_method"]

_REGISTRY: dict[str, Callable[..., Any]] = {}
#: Names registered with ``generic=True``: accepted by :func:`make_cache`, listed apart.
_GENERIC: set = set()
_LOCK = threading.Lock()


def register_method(name: str, *, replace: bool = False, generic: bool = False):
    """Decorator that registers a cache class or factory function under ``name``.

    The decorated callable is called as ``factory(num_layers=..., num_kv_heads=...,
    head_dim=..., **options)`` and must return an object satisfying
    :class:`~arraykv.CompressedKVCache`.

    Parameters
    ----------
    name : str
        Method name, lower case, without spaces.
    replace : bool, default False
        Allow replacing an existing registration.
    generic : bool, default False
        A family that needs options to be a cache (``"polar"`` needs its bits): accepted by
        :func:`make_cache` and by :func:`arraykv.load`, but listed by
        :func:`available_methods` only with ``generic=True``.

    Notes
    -----
    A registered class should set its ``method`` class attribute to ``name``: the cache's
    :meth:`~arraykv.caches.LayeredCache.get_config` reports it, so that
    ``make_cache(**cache.get_config())`` and a saved file rebuild the same class.

    Examples
    --------
    >>> import arraykv
    >>> @arraykv.register_method("my-dense", replace=True)
    ... class MyDense(arraykv.DenseCache):
    ...     pass
    >>> "my-dense" in arraykv.available_methods()
    True
    """
    if not isinstance(name, str) or not name or name != name.strip() or " " in name:
        raise ValueError(f"name must be a non-empty string without spaces, received {name!r}")

    def deco(factory):
        if not callable(factory):
            raise TypeError(f"register_method needs a class or function, received {type(factory).__name__}")
        if isinstance(factory, type) and "method" not in vars(factory):
            factory.method = name  # the class's own name, so its files and configs rebuild it
        with _LOCK:
            if name in _REGISTRY and not replace and _REGISTRY[name] is not factory:
                raise ValueError(f"method {name!r} is already registered; pass replace=True to replace it")
            _REGISTRY[name] = factory
            if generic:
                _GENERIC.add(name)
            else:
                _GENERIC.discard(name)
        return factory

    return deco


def available_methods(*, generic: bool = False) -> list:
    """Names of the ready-to-use methods, sorted; with ``generic=True`` also the families that
    need options (``"polar"``, ``"int"``): everything :func:`make_cache` accepts."""
    _load_builtin()
    with _LOCK:
        return sorted(n for n in _REGISTRY if generic or n not in _GENERIC)


def make_cache(method: str, *, num_layers: int, num_kv_heads: int, head_dim: int, **options: Any):
    """Create a cache by method name.

    Parameters
    ----------
    method : str
        One of :func:`available_methods` (``"dense"``, ``"pqo4"``, ...).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    **options
        Method-specific options (see each cache's docstring).

    Returns
    -------
    CompressedKVCache
    """
    _load_builtin()
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, received {type(method).__name__}")
    with _LOCK:
        factory = _REGISTRY.get(method)
        names = sorted(_REGISTRY)
    if factory is None:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(names)}")

    try:
        return factory(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, **options)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise TypeError(f"method {method!r} does not take that option: {exc}") from None
        raise


def _load_builtin() -> None:
    # Importing the cache modules registers them; done lazily to avoid import cycles.
    from . import _builtin  # noqa: F401
