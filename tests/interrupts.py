"""A cache that fails at a chosen call, and the comparison of whole cache states (for the tests of
interrupted calls).

:class:`FailingCache` stands in for a cache: it counts the calls that store tokens (``prefill``,
``decode``, ``append``) and makes call number ``at`` fail with ``exc``, in one of three places:
``"before"`` the cache is called (the engine failed between two layers), ``"inside"`` the cache
(its tokens stored and its result built, just before the layer counts them: the worst moment
inside a layer) or ``"after"`` it returned (the layer holds the tokens; a later layer or the
engine failed). Everything else goes to the cache itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MODES = ("before", "inside", "after")


def _parts(cache: Any) -> list:
    """The LayeredCache objects behind ``cache`` (both parts of a hybrid one)."""
    return [cache.full, cache.sliding] if hasattr(cache, "full") else [cache]


class FailingCache:
    """``cache`` with store call number ``at`` (from 0) failing with ``exc`` at ``mode``; -1: none."""

    def __init__(self, cache: Any, at: int = -1, exc: type[BaseException] = MemoryError, mode: str = "before"):
        assert mode in MODES
        self._cache, self.at, self.exc, self.mode = cache, at, exc, mode
        self.calls = 0
        self._armed = False
        self._patched = []
        if mode == "inside":
            for part in _parts(cache):
                original = part._commit

                def commit(layer, state, tokens, _original=original):
                    if self._armed:
                        self._armed = False
                        raise self.exc("injected inside the cache")
                    _original(layer, state, tokens)

                part._commit = commit
                self._patched.append(part)

    def restore_cache(self) -> None:
        """Take the injected hook out of the cache again."""
        for part in self._patched:
            del part._commit
        self._patched = []

    def _call(self, name: str, *args: Any) -> Any:
        hit = self.calls == self.at
        self.calls += 1
        if hit and self.mode == "before":
            raise self.exc("injected before the cache")
        self._armed = hit and self.mode == "inside"
        try:
            out = getattr(self._cache, name)(*args)
        finally:
            self._armed = False
        if hit and self.mode == "after":
            raise self.exc("injected after the cache")
        return out

    def prefill(self, *args: Any) -> Any:
        return self._call("prefill", *args)

    def decode(self, *args: Any) -> Any:
        return self._call("decode", *args)

    def append(self, *args: Any) -> Any:
        return self._call("append", *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def cache_state(cache: Any, num_layers: int) -> tuple:
    """Everything a cache holds that its next calls depend on: per layer its length and
    arrays, the configuration, and the bytes it holds besides spare room."""
    layers = [
        (int(cache.seq_len(i)), {n: np.array(a) for n, a in cache.layer_arrays(i).items()}) for i in range(num_layers)
    ]
    return layers, cache.get_config(), int(cache.used_bytes())


def assert_same_state(got: tuple, want: tuple, what: str = "") -> None:
    """``got`` equals ``want`` (both :func:`cache_state`) bit for bit."""
    (g_layers, g_cfg, g_used), (w_layers, w_cfg, w_used) = got, want
    assert g_cfg == w_cfg, what
    assert [n for n, _ in g_layers] == [n for n, _ in w_layers], f"{what}: lengths"
    for i, ((_, ga), (_, wa)) in enumerate(zip(g_layers, w_layers)):
        assert ga.keys() == wa.keys(), f"{what}: layer {i} arrays {sorted(ga)} != {sorted(wa)}"
        for name in wa:
            np.testing.assert_array_equal(ga[name], wa[name], err_msg=f"{what}: layer {i} {name}")
    assert g_used == w_used, f"{what}: used_bytes"
