"""One cache for a model whose layers attend differently: global layers and sliding-window layers.

Hybrid models (Gemma 2/3, Mistral-style windows, Qwen with sliding layers, gpt-oss) mix layers
that attend to the whole past with layers that attend to the last ``window`` tokens. A
:class:`HybridCache` gives each kind its own cache: the global layers any method (``pqo4``,
``int4``, ...), the sliding layers a :class:`~arraykv.caches.window_cache.SlidingWindowCache`
that holds the window only. Both sub-caches have the model's number of layers and keep the
model's layer indices; each serves only the layers of its kind, so the other's entries stay
empty and cost nothing.

The hybrid cache is itself a cache of the contract (prefill, decode, seq_len, reset,
memory_usage), with the same extensions as the built-in caches (truncate, fork, snapshot,
restore, save and :func:`arraykv.load`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from .._types import Array, Namespace
from .._validation import check_int
from ..protocol import (
    AttendConfig,
    BatchRowsKVCache,
    CompressedKVCache,
    DecodeOutput,
    DequantResult,
    IncrementalKVCache,
    LayerRoutedKVCache,
    SnapshotKVCache,
    TransactionalKVCache,
    TruncatableKVCache,
    contract_doc,
)
from ..storage.cache_file import LayerRecord, write_cache_file
from .base import LayeredCache
from .batch_rows import select_rows_of
from .registry import make_cache
from .rollback import LayerRollback
from .transaction import CacheTransaction
from .window_cache import OUTLIER_OPTIONS, POLAR_STORAGE, SlidingWindowCache

__all__ = ["HybridCache", "HybridTransaction", "LAYER_TYPES", "check_layer_types", "default_window_storage"]

#: The layer kinds a hybrid cache serves, named as transformers' ``config.layer_types`` names them.
LAYER_TYPES = ("full_attention", "sliding_attention")

#: Kinds transformers knows that no arraykv cache serves yet, with the reason.
_REFUSED = {
    "chunked_attention": "chunked attention (Llama 4's local layers) is not supported yet",
    "linear_attention": "linear-attention layers keep a recurrent state, not a KV cache; not supported",
    "mamba": "state-space (Mamba) layers keep a recurrent state, not a KV cache; not supported",
    "conv": "convolution layers keep a rolling state, not a KV cache; not supported",
}


def check_layer_types(layer_types: Any, num_layers: int | None = None) -> tuple:
    """``layer_types`` as a tuple of :data:`LAYER_TYPES` names, or a clear error.

    Raises
    ------
    TypeError
        Not a sequence of strings.
    ValueError
        A kind no cache serves (named, with the reason), or a length other than ``num_layers``.
    """
    if isinstance(layer_types, str) or not hasattr(layer_types, "__len__"):
        raise TypeError(f"layer_types must be a sequence of strings, received {type(layer_types).__name__}")
    kinds = tuple(layer_types)
    for i, kind in enumerate(kinds):
        if not isinstance(kind, str):
            raise TypeError(f"layer_types[{i}] must be a string, received {type(kind).__name__}")
        if kind not in LAYER_TYPES:
            why = _REFUSED.get(kind, f"the kinds served are {', '.join(LAYER_TYPES)}")
            raise ValueError(f"layer {i} is of kind {kind!r}: {why}")
    if num_layers is not None and len(kinds) != num_layers:
        raise ValueError(f"layer_types must name num_layers={num_layers} kinds, received {len(kinds)}")
    return kinds


def default_window_storage(full_method: str, full_options: dict | None = None) -> str:
    """The sliding layers' storage that matches a global method.

    ``"dense"`` keeps windows exact; a method of ``B`` = 2, 3 or 4 bits per value (the digit
    of ``pqoB``, ``pqB``, ``tqB``, ``intB``, or the generic ``polar`` method's ``key_bits``)
    holds them in the calibrated ``pq`` codec of ``max(B + 1, 4)`` bits
    (:data:`~arraykv.caches.window_cache.POLAR_STORAGE`) with an exact tail of 8 tokens:
    5-bit windows for 4-bit methods, 4-bit windows for 3- and 2-bit ones; anything else
    (``int8``, ``lowrank``, ``vq``) holds them in float16.

    Notes
    -----
    A sliding layer's whole attention span is its window, so its error is not diluted over a
    long context as a global layer's is, and a hybrid model has many of them (Gemma 3: 5 of
    every 6 layers). Measured on Gemma-3-270M, 128 positions after 3,840 tokens through the
    chunked prefill (``docs/algorithms.md`` §12): ``pqo4`` with 4-bit windows has a mean KL
    of 0.0086 at 4.56 bits per value, with 5-bit windows 0.0021 at 4.96 (float16 windows:
    0.00076 at 9.15); ``pqo3`` with 3-bit windows 0.036, with 4-bit ones 0.011. The extra bit
    costs less as the context grows past the window (the windows stay 528 rows): ``pqo4``
    holds 4.78 bits per value at 8k tokens (4.96 at 4k); 4.45 since the exact outlier channels
    are chosen on the weighted keys (``docs/algorithms.md`` §8).

    Windows are never below 4 bits: after 32,640 tokens (64 positions, the same path)
    ``pqo2`` with 3-bit windows had a mean KL of 0.064 at 2.25 bits per value, of which
    the windows alone (exact global layers) made 0.032 and the 2-bit global layers alone
    (float16 windows) 0.030; with 4-bit windows 0.034 at 2.33.
    """
    if full_method == "dense":
        return "exact"
    bits = None
    if full_method == "polar":
        bits = (full_options or {}).get("key_bits")
    elif full_method[-1:].isdigit() and full_method.rstrip("0123456789") in ("pq", "pqo", "tq", "int"):
        bits = int(full_method[len(full_method.rstrip("0123456789")) :])
    return f"pq{max(bits + 1, 4)}" if bits in (2, 3, 4) else "float16"


_A = ParamSpec("_A")
_R = TypeVar("_R")


def _delegate(source: Callable[..., Any], method: Callable[..., Any]) -> None:
    """Name ``method`` as ``source`` on :class:`HybridCache`, with its docstring and signature."""
    method.__name__ = source.__name__
    method.__qualname__ = f"HybridCache.{source.__name__}"
    method.__doc__ = source.__doc__
    method.__signature__ = inspect.signature(source)  # type: ignore[attr-defined]  # what help() and numpydoc read


def _routed(source: Callable[Concatenate[Any, _A], _R]) -> Callable[Concatenate[Any, _A], _R]:
    """A :class:`HybridCache` method that calls its namesake on the part serving ``layer``, its
    first argument (``source``: the method whose docstring, the contract's, it takes)."""
    name = source.__name__

    def method(self: HybridCache, layer: int, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.cache_of(layer), name)(layer, *args, **kwargs)

    def command(self: HybridCache, layer: int, *args: Any, **kwargs: Any) -> None:  # returns nothing, as numpydoc reads
        getattr(self.cache_of(layer), name)(layer, *args, **kwargs)

    chosen = command if inspect.signature(source).return_annotation in (None, "None") else method
    _delegate(source, chosen)
    return cast(Callable[Concatenate[Any, _A], _R], chosen)


def _summed(source: Callable[[Any], int]) -> Callable[[Any], int]:
    """A :class:`HybridCache` method that adds up its namesake over both parts (``source`` as in
    :func:`_routed`)."""
    name = source.__name__

    def method(self: HybridCache) -> int:
        return int(getattr(self.full, name)() + getattr(self.sliding, name)())

    _delegate(source, method)
    return method


class HybridTransaction:
    """A transaction of both parts of a :class:`HybridCache` (global and sliding layers).

    Parameters
    ----------
    full, sliding : CacheTransaction
        The parts' open transactions.
    """

    def __init__(self, full: CacheTransaction, sliding: CacheTransaction):
        self.full = full
        self.sliding = sliding

    @property
    def open(self) -> bool:
        """True until :meth:`commit` or :meth:`rollback`."""
        return self.full.open or self.sliding.open

    @property
    def layers(self) -> list[int]:
        """The layers changed so far, ascending."""
        return sorted(self.full.layers + self.sliding.layers)

    def commit(self) -> None:
        """Keep what the calls did (both parts)."""
        self.sliding.commit()
        self.full.commit()

    def rollback(self) -> None:
        """Put every layer changed since the transaction began back as it was (both parts)."""
        try:
            self.sliding.rollback()
        finally:
            self.full.rollback()

    def __repr__(self) -> str:
        return f"HybridTransaction({'open' if self.open else 'ended'}, layers={self.layers})"


class HybridCache(
    CompressedKVCache,
    IncrementalKVCache,
    TruncatableKVCache,
    TransactionalKVCache,
    SnapshotKVCache,
    BatchRowsKVCache,
    LayerRoutedKVCache,
):
    """Global layers in one cache method, sliding-window layers in a window cache.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry: layers, KV heads per layer and channels per head (both sub-caches
        get it).
    layer_types : sequence of str
        Per layer ``"full_attention"`` or ``"sliding_attention"`` (transformers' names).
    window : int
        The sliding layers' attention span (a token sees itself and ``window - 1`` before it).
    full_method : str, default "dense"
        Method of the global layers (any :func:`arraykv.available_methods` name).
    full_options : dict, optional
        Options of that method.
    window_options : dict, optional
        Options of the :class:`~arraykv.caches.window_cache.SlidingWindowCache`
        (``storage``, ``exact_tail``, ``decode_path``, ``rollback_tokens``, ``seed``,
        ``outliers``, ``outlier_threshold``, ``max_outliers``); ``storage`` defaults to
        :func:`default_window_storage` of the global method, and compressed windows take the
        outlier options of ``full_options`` unless these name their own.
    check_finite : bool, default True
        Reject keys and values that hold NaN or infinity (both sub-caches get it).
    max_tokens : int, optional
        Tokens a layer may hold (both sub-caches get it).

    Notes
    -----
    ``prefill`` and ``decode`` of a sliding layer return only the tokens it holds (the last
    positions): see :mod:`arraykv.caches.window_cache` for how a caller masks them.

    Its capabilities are those its bases, the protocols of :mod:`arraykv.protocol`, declare;
    a per-layer method is answered by the part serving the layer (:meth:`cache_of`), a
    cache-wide one by both parts. The parts' own capabilities (the window cache's
    ``append_last``) are reached through :meth:`cache_of`.
    """

    method = "hybrid"

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layer_types: Any,
        window: int,
        full_method: str = "dense",
        full_options: dict | None = None,
        window_options: dict | None = None,
        check_finite: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        self.num_layers = check_int("num_layers", num_layers, low=1)
        self.layer_types = check_layer_types(layer_types, self.num_layers)
        self.window = check_int("window", window, low=1)
        if not isinstance(full_method, str) or full_method in ("hybrid", "window"):
            raise ValueError(f"full_method must name a method for global layers, received {full_method!r}")
        for name, opts in (("full_options", full_options), ("window_options", window_options)):
            if opts is not None and not isinstance(opts, dict):
                raise TypeError(f"{name} must be a dict, received {type(opts).__name__}")
        self.full_method = full_method
        self.full_options = dict(full_options or {})
        self.window_options = dict(window_options or {})
        self.window_options.setdefault("storage", default_window_storage(full_method, self.full_options))
        if self.window_options["storage"] in POLAR_STORAGE:  # the windows' codec takes the global outlier options
            for name in OUTLIER_OPTIONS:
                if name in self.full_options:
                    self.window_options.setdefault(name, self.full_options[name])
        common: dict[str, Any] = dict(
            num_layers=self.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            check_finite=check_finite,
            max_tokens=max_tokens,
        )
        # every method but hybrid (refused above) makes a LayeredCache; "window" a SlidingWindowCache
        self.full = cast(LayeredCache, make_cache(full_method, **common, **self.full_options))
        self.sliding = cast(
            SlidingWindowCache, make_cache("window", window=self.window, **common, **self.window_options)
        )
        self.num_kv_heads = self.full.num_kv_heads
        self.head_dim = self.full.head_dim
        self.check_finite = check_finite
        self.max_tokens = max_tokens

    # -- routing -----------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window layer.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        bool
            True where ``layer_types[layer]`` is ``"sliding_attention"``.
        """
        kind: str = self.layer_types[check_int("layer", layer, low=0, high=self.num_layers - 1)]
        return kind == "sliding_attention"

    def cache_of(self, layer: int) -> LayeredCache:
        """The sub-cache that serves ``layer`` (:class:`~arraykv.protocol.LayerRoutedKVCache`).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        LayeredCache
            :attr:`sliding` (a :class:`~arraykv.caches.window_cache.SlidingWindowCache`) for
            a sliding layer, else :attr:`full`.
        """
        return self.sliding if self.is_sliding(layer) else self.full

    def _parts(self) -> tuple:
        return (self.full, self.sliding)

    # -- the contract (arraykv.protocol states it) ----------------------------------------
    @contract_doc(CompressedKVCache.prefill)
    def prefill(self, layer: int, k: Array, v: Array, q: Array) -> DequantResult:
        return self.cache_of(layer).prefill(layer, k, v, q)

    @contract_doc(CompressedKVCache.decode)
    def decode(self, layer: int, k: Array, v: Array, q: Array, config: AttendConfig) -> DecodeOutput:
        return self.cache_of(layer).decode(layer, k, v, q, config)

    @contract_doc(CompressedKVCache.seq_len)
    def seq_len(self, layer: int) -> int:
        return self.cache_of(layer).seq_len(layer)

    def reset(self) -> None:
        """Forget every token of every layer (both sub-caches reset)."""
        for c in self._parts():
            c.reset()

    def memory_usage(self) -> int:
        """Bytes held by both kinds of layers (:meth:`memory_by_kind` splits them).

        Returns
        -------
        int
            The sum of both sub-caches' ``memory_usage()``.
        """
        return sum(c.memory_usage() for c in self._parts())

    # -- per layer: the part serving the layer answers -------------------------------------
    append = _routed(IncrementalKVCache.append)
    stable_length = _routed(IncrementalKVCache.stable_length)
    dequantize = _routed(IncrementalKVCache.dequantize)
    layer_arrays = _routed(LayeredCache.layer_arrays)
    truncate = _routed(TruncatableKVCache.truncate)
    min_truncate_length = _routed(TruncatableKVCache.min_truncate_length)
    can_truncate = _routed(TruncatableKVCache.can_truncate)

    # -- over both parts -------------------------------------------------------------------
    @property
    def rewrites(self) -> int:
        """Both parts' changes other than stores of new tokens (see
        :attr:`arraykv.protocol.IncrementalKVCache.rewrites`)."""
        return int(self.full.rewrites + self.sliding.rewrites)

    used_bytes = _summed(LayeredCache.used_bytes)
    rollback_bytes = _summed(LayerRollback.rollback_bytes)
    reallocations = _summed(LayeredCache.reallocations)

    def memory_by_kind(self) -> dict:
        """``{"full_attention": bytes, "sliding_attention": bytes}`` (:meth:`memory_usage` of each part).

        Returns
        -------
        dict of str to int
            Bytes of the global layers' and of the sliding layers' sub-cache.
        """
        return {"full_attention": self.full.memory_usage(), "sliding_attention": self.sliding.memory_usage()}

    def reserved_bytes(self) -> int:
        """Bytes allocated, spare capacity included: the same as :meth:`memory_usage`.

        Returns
        -------
        int
            :meth:`memory_usage`.
        """
        return self.memory_usage()

    @property
    def decode_path(self) -> str:
        """The global layers' decode path (sliding layers always return K/V)."""
        return getattr(self.full, "decode_path", "dequantized")

    def held_tokens(self, layer: int) -> int:
        """Tokens ``layer`` holds: ``seq_len`` for a global layer, at most the window (plus the
        rollback margin) for a sliding one.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            The token rows held, 0 for an empty layer.
        """
        return self.sliding.held_tokens(layer) if self.is_sliding(layer) else self.full.seq_len(layer)

    # -- transactions ----------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[HybridTransaction]:
        """Calls on several layers that take effect together or not at all (both parts).

        As :meth:`arraykv.protocol.TransactionalKVCache.transaction` states it: when the block
        raises anything, every layer it changed, global or sliding, is put back exactly as it was.

        Yields
        ------
        HybridTransaction
            The two parts' transactions; its ``commit()`` or ``rollback()`` ends it early.
        """
        txn = self.begin_transaction()
        try:
            yield txn
        except BaseException:
            txn.rollback()
            raise
        txn.commit()

    @contract_doc(TransactionalKVCache.begin_transaction)
    def begin_transaction(self) -> HybridTransaction:
        full = self.full.begin_transaction()
        try:
            sliding = self.sliding.begin_transaction()
        except BaseException:
            full.rollback()
            raise
        return HybridTransaction(full, sliding)

    # -- rollback --------------------------------------------------------------------------
    @contract_doc(TruncatableKVCache.truncate_all)
    def truncate_all(self, length: int) -> None:
        length = check_int("length", length, low=0)
        top = max(self.seq_len(i) for i in range(self.num_layers))
        if length > top:
            raise ValueError(f"length must be in [0, {top}] (the longest layer's seq_len), received {length}")
        for i in range(self.num_layers):
            n = self.seq_len(i)
            if length < n and not self.can_truncate(i, length):
                c = self.cache_of(i)
                c.truncate(i, length)  # raises the sub-cache's message; nothing changed yet
        for c in self._parts():
            if any(c.seq_len(i) > length for i in range(self.num_layers)):
                c.truncate_all(length)

    def fork(self) -> HybridCache:
        """An independent copy (both parts forked).

        Returns
        -------
        HybridCache
            A cache of the same configuration whose sub-caches are forks of this one's.
        """
        twin = object.__new__(HybridCache)
        twin.__dict__.update(self.__dict__)
        twin.full = self.full.fork()
        twin.sliding = self.sliding.fork()
        return twin

    # -- batch rows --------------------------------------------------------------------
    @contract_doc(BatchRowsKVCache.select_rows)
    def select_rows(self, indices: Any) -> None:
        select_rows_of([self.full, self.sliding], indices)

    @contract_doc(BatchRowsKVCache.batch_size)
    def batch_size(self) -> int:
        sizes = {s for s in (self.full.batch_size(), self.sliding.batch_size()) if s}
        if len(sizes) > 1:
            raise ValueError(f"the layers hold different batches {sorted(sizes)}; no one batch size")
        return sizes.pop() if sizes else 0

    # -- persistence -------------------------------------------------------------------
    def get_config(self) -> dict:
        """Arguments that rebuild this cache: ``make_cache(**cfg)``.

        Returns
        -------
        dict
            ``method="hybrid"`` and the constructor's arguments.
        """
        return {
            "method": "hybrid",
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "window": self.window,
            "full_method": self.full_method,
            "full_options": dict(self.full_options),
            "window_options": dict(self.window_options),
            "check_finite": self.check_finite,
            "max_tokens": self.max_tokens,
        }

    @contract_doc(SnapshotKVCache.snapshot)
    def snapshot(self, *, host: bool = False) -> list[LayerRecord | None]:
        full, win = self.full.snapshot(host=host), self.sliding.snapshot(host=host)
        return [win[i] if kind == "sliding_attention" else full[i] for i, kind in enumerate(self.layer_types)]

    @contract_doc(SnapshotKVCache.restore)
    def restore(self, layers: list[LayerRecord | None], *, xp: Namespace | None = None) -> None:
        if not isinstance(layers, (list, tuple)) or len(layers) != self.num_layers:
            raise ValueError(f"layers must be a list of num_layers={self.num_layers} entries")
        sliding = [kind == "sliding_attention" for kind in self.layer_types]
        full_recs = [None if s else r for s, r in zip(sliding, layers)]
        win_recs = [r if s else None for s, r in zip(sliding, layers)]
        before = self.full.snapshot()
        self.full.restore(full_recs, xp=xp)
        try:
            self.sliding.restore(win_recs, xp=xp)
        except BaseException:
            self.full.restore(before)
            raise

    def save(self, path: str | os.PathLike) -> int:
        """Write the cache to ``path`` (as :func:`arraykv.persist.save_cache` does); :func:`arraykv.load` reads it.

        Parameters
        ----------
        path : str or path-like
            Target file; replaced atomically.

        Returns
        -------
        int
            Size of the file written, in bytes.
        """
        return write_cache_file(path, self.get_config(), self.snapshot(host=True))

    def __repr__(self) -> str:
        n_win = sum(1 for k in self.layer_types if k == "sliding_attention")
        return (
            f"HybridCache(full_method={self.full_method!r}, window={self.window}, "
            f"global_layers={self.num_layers - n_win}, sliding_layers={n_win})"
        )
