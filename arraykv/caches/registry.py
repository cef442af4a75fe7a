"""The cache factory: method names to cache constructors.

A method is registered under its name with either the ``"module:attr"`` path of its class or
factory (the built-in methods, listed at the bottom of this module, as the op registry lists
its ops: nothing is imported until a cache of that method is made) or the callable itself
(:func:`register_method` as a decorator, for a third party's cache).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..protocol import CompressedKVCache

__all__ = ["make_cache", "available_methods", "register_method"]

_F = TypeVar("_F", bound=Callable[..., Any])

#: Method name -> its factory, or the ``"module:attr"`` path of one not imported yet.
_REGISTRY: dict[str, Callable[..., CompressedKVCache] | str] = {}
#: Names registered with ``generic=True``: accepted by :func:`make_cache`, listed apart.
_GENERIC: set[str] = set()
_LOCK = threading.Lock()


def register_method(
    name: str, target: str | None = None, *, replace: bool = False, generic: bool = False
) -> Callable[[_F], _F] | None:
    """Register a cache class or factory function under ``name``.

    The factory is called as ``factory(num_layers=..., num_kv_heads=..., head_dim=...,
    **options)`` and must return an object satisfying :class:`~arraykv.CompressedKVCache`.

    Parameters
    ----------
    name : str
        Method name, lower case, without spaces.
    target : str, optional
        The factory's ``"module:attr"`` path, imported the first time a cache of ``name`` is
        made. Without it, ``register_method`` returns a decorator that registers the decorated
        class or function.
    replace : bool, default False
        Allow replacing an existing registration.
    generic : bool, default False
        A family that needs options to be a cache (``"polar"`` needs its bits): accepted by
        :func:`make_cache` and by :func:`arraykv.load`, but listed by
        :func:`available_methods` only with ``generic=True``.

    Returns
    -------
    callable or None
        The decorator when ``target`` is None; None otherwise.

    Notes
    -----
    A registered class should set its ``method`` class attribute to ``name``: the cache's
    :meth:`~arraykv.caches.LayeredCache.get_config` reports it, so that
    ``make_cache(**cache.get_config())`` and a saved file rebuild the same class. A class
    without one gets ``name``. Decorating the very class a path registration names is
    the same registration, not a second one.

    What a cache offers besides the contract (truncation, transactions, snapshots, ...) the
    integrations ask with :func:`arraykv.protocol.supports`; a class declares it by
    subclassing the protocols of :mod:`arraykv.protocol` (as a subclass of
    :class:`~arraykv.caches.LayeredCache` inherits them) or simply by defining their methods.

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
    if target is not None:
        if not isinstance(target, str) or target.count(":") != 1:
            raise ValueError(f"target must be a 'module:attr' path, received {target!r}")
        _put(name, target, replace, generic)
        return None

    def deco(factory: _F) -> _F:
        if not callable(factory):
            raise TypeError(f"register_method needs a class or function, received {type(factory).__name__}")
        if isinstance(factory, type) and "method" not in vars(factory):
            factory.method = name  # type: ignore[attr-defined]  # the class's own name, so its files and configs rebuild it
        _put(name, factory, replace, generic)
        return factory

    return deco


def _path(factory: Callable[..., CompressedKVCache]) -> str:
    return f"{getattr(factory, '__module__', '')}:{getattr(factory, '__qualname__', '')}"


def _put(name: str, entry: Callable[..., CompressedKVCache] | str, replace: bool, generic: bool) -> None:
    with _LOCK:
        old = _REGISTRY.get(name)
        same = old is entry or (isinstance(old, str) and not isinstance(entry, str) and old == _path(entry))
        if old is not None and not replace and not same:
            raise ValueError(f"method {name!r} is already registered; pass replace=True to replace it")
        _REGISTRY[name] = entry
        if generic:
            _GENERIC.add(name)
        else:
            _GENERIC.discard(name)


def _factory(name: str) -> Callable[..., CompressedKVCache] | None:
    """The factory of ``name`` (imported on first use when registered by path), or None."""
    with _LOCK:
        entry = _REGISTRY.get(name)
    if not isinstance(entry, str):
        return entry
    module, attr = entry.split(":")
    factory: Callable[..., CompressedKVCache] = getattr(importlib.import_module(module), attr)
    if isinstance(factory, type) and "method" not in vars(factory):
        factory.method = name  # type: ignore[attr-defined]  # as the decorator does
    with _LOCK:
        if _REGISTRY.get(name) == entry:
            _REGISTRY[name] = factory
    return factory


def available_methods(*, generic: bool = False) -> list[str]:
    """Names of the ready-to-use methods, sorted.

    Parameters
    ----------
    generic : bool, default False
        Also list the families that need options (``"polar"``, ``"int"``): everything
        :func:`make_cache` accepts.

    Returns
    -------
    list of str
        The registered method names, sorted.
    """
    with _LOCK:
        return sorted(n for n in _REGISTRY if generic or n not in _GENERIC)


def make_cache(method: str, *, num_layers: int, num_kv_heads: int, head_dim: int, **options: Any) -> CompressedKVCache:
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
        What the method's registered class or factory returns for this geometry and these
        options.
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, received {type(method).__name__}")
    factory = _factory(method)
    if factory is None:
        with _LOCK:
            names = sorted(_REGISTRY)
        raise ValueError(f"unknown method {method!r}; available: {', '.join(names)}")

    try:
        return factory(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, **options)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise TypeError(f"method {method!r} does not take that option: {exc}") from None
        raise


_C = "arraykv.caches"
register_method("dense", f"{_C}.dense:DenseCache")
register_method("polar", f"{_C}.polar:PolarCache", generic=True)
for _name in ("pqo2", "pqo3", "pqo4", "pq2", "pq3", "pq4", "tq2", "tq3", "tq4"):
    register_method(_name, f"{_C}.polar:{_name.capitalize()}Cache")
register_method("int", f"{_C}.intq:IntQuantCache", generic=True)
register_method("int2", f"{_C}.intq:Int2Cache")
register_method("int4", f"{_C}.intq:Int4Cache")
register_method("int8", f"{_C}.intq:Int8Cache")
register_method("lowrank", f"{_C}.lowrank:LowRankCache")
register_method("vq", f"{_C}.vq:VQCache")
register_method("window", f"{_C}.window_cache:SlidingWindowCache", generic=True)
register_method("hybrid", f"{_C}.hybrid:HybridCache", generic=True)
del _name
