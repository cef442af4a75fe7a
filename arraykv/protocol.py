"""The compressed KV-cache contract.

A Python rendering of the ``CompressedKVCache`` trait: five methods, two result types and one
attention configuration. Every cache in :mod:`arraykv.caches` satisfies it, and so can a third
party's cache registered with :func:`arraykv.register_method`.

Shapes
------
``k``, ``v``
    ``(batch, kv_heads, new_tokens, head_dim)``
``q``
    ``(batch, q_heads, new_tokens, head_dim)`` with ``q_heads = kv_heads * n_kv_groups``;
    query head ``h`` attends with KV head ``h // n_kv_groups``.
``DequantResult.k``, ``DequantResult.v``
    ``(batch, kv_heads, total_tokens, head_dim)``: every token stored so far in that layer.
``DequantResult.logit_bias``
    ``None`` or ``(batch, q_heads, new_tokens, total_tokens)``, added to the already scaled
    logits before the softmax.
``Fused.output``
    ``(batch, q_heads, 1, head_dim)``.

Arrays come back in the namespace, device and dtype of the input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeGuard, TypeVar, runtime_checkable

from ._types import Array, Namespace
from ._validation import check_int, check_softmax_scale

__all__ = [
    "AttendConfig",
    "DequantResult",
    "Fused",
    "Dequantized",
    "DecodeOutput",
    "CompressedKVCache",
    "IncrementalKVCache",
    "TruncatableKVCache",
    "KVTransaction",
    "TransactionalKVCache",
    "SnapshotKVCache",
    "BatchRowsKVCache",
    "LayerRoutedKVCache",
    "WindowTailKVCache",
    "PrefillTarget",
    "Capability",
    "CAPABILITIES",
    "KV_CACHE",
    "INCREMENTAL",
    "TRUNCATION",
    "TRANSACTIONS",
    "SNAPSHOTS",
    "BATCH_ROWS",
    "LAYER_ROUTING",
    "WINDOW_TAIL",
    "PREFILL_TARGET",
    "supports",
    "declares",
    "capabilities",
    "contract_doc",
]

_P = TypeVar("_P")
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class AttendConfig:
    """How decode attention is computed.

    Parameters
    ----------
    softmax_scale : float
        Multiplies ``q · k`` before the softmax (usually ``1 / sqrt(head_dim)``).
    n_kv_groups : int, default 1
        Query heads per KV head (grouped-query attention); 1 is multi-head attention.
    """

    softmax_scale: float
    n_kv_groups: int = 1

    def __post_init__(self) -> None:
        # NumPy scalars are accepted and stored as Python float/int.
        object.__setattr__(self, "softmax_scale", check_softmax_scale(self.softmax_scale))
        object.__setattr__(self, "n_kv_groups", check_int("n_kv_groups", self.n_kv_groups, low=1))


@dataclass(frozen=True)
class DequantResult:
    """Keys and values of every stored token, ready for attention.

    Parameters
    ----------
    k, v : array, shape (batch, kv_heads, total_tokens, head_dim)
        Keys and values, in the dtype of the input.
    logit_bias : array or None, shape (batch, q_heads, new_tokens, total_tokens)
        Added to the scaled logits before the softmax (for example the QJL correction of
        TurboQuant-prod keys, already multiplied by the softmax scale).
    """

    k: Array
    v: Array
    logit_bias: Array | None = None


@dataclass(frozen=True)
class Fused:
    """Decode computed attention itself.

    Parameters
    ----------
    output : array, shape (batch, q_heads, 1, head_dim)
        The attention output of the new token, in the namespace, device and dtype of the input.
    """

    output: Array


@dataclass(frozen=True)
class Dequantized:
    """Decode returns keys and values; the caller runs attention.

    Parameters
    ----------
    result : DequantResult
        Keys and values of every stored token of the layer, the new one included.
    """

    result: DequantResult


DecodeOutput = Fused | Dequantized


@runtime_checkable
class CompressedKVCache(Protocol):
    """A per-layer KV cache that stores keys and values in compressed form.

    Every method is safe to call from several threads: calls on different layers run in
    parallel, calls on the same layer are serialized.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated (``TypeError``): a
        cache satisfies the protocol by defining its methods, not by subclassing or calling it.
    """

    def prefill(self, layer: int, k: Array, v: Array, q: Array) -> DequantResult:
        """Store ``new_tokens`` keys/values and return K/V of all tokens stored in ``layer``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, new_tokens, head_dim)
            Keys (after RoPE) and values of the new tokens, floating, in the namespace, device,
            batch and dtype of the tokens the layer already holds.
        q : array, shape (batch, q_heads, new_tokens, head_dim)
            Queries of the new tokens, ``q_heads`` a multiple of ``kv_heads`` (a cache may use
            them, for example to weight key channels).

        Returns
        -------
        DequantResult
            Keys and values of every token stored in ``layer``, the new ones included, shape
            ``(batch, kv_heads, total, head_dim)`` in the input dtype (a sliding-window layer:
            the positions it holds, the last ones).
        """
        ...

    def decode(self, layer: int, k: Array, v: Array, q: Array, config: AttendConfig) -> DecodeOutput:
        """Store exactly one new token and return attention (``Fused``) or K/V (``Dequantized``).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, 1, head_dim)
            Key (after RoPE) and value of the new token.
        q : array, shape (batch, q_heads, 1, head_dim)
            Query of the new token.
        config : AttendConfig
            Softmax scale and grouped-query layout, for a cache that computes attention itself;
            ``n_kv_groups`` must equal ``q_heads // kv_heads``.

        Returns
        -------
        Fused or Dequantized
            :class:`Fused` (the attention output of the new token) where the cache attends from
            its compressed form itself, else :class:`Dequantized` (the keys and values of every
            stored token, for the caller to attend over).
        """
        ...

    def seq_len(self, layer: int) -> int:
        """Tokens stored in ``layer``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            Tokens given to ``layer`` so far (0 when empty), positions for a sliding-window
            layer too.
        """
        ...

    def reset(self) -> None:
        """Forget every stored token of every layer."""
        ...

    def memory_usage(self) -> int:
        """Bytes of compressed state actually held, over all layers.

        Returns
        -------
        int
            Bytes of the stored tokens' compressed form, over every layer.
        """
        ...


# -- capabilities beyond the five methods ---------------------------------------------------
#
# What the integrations (decoders, ONNX Runtime, transformers, prompt staging, the store) call
# besides the contract, grouped by what it lets them do. Each group is a protocol: a type
# checker holds a cache to it structurally, and at run time :func:`supports` answers whether a
# cache has it. The built-in caches declare their groups by subclassing the protocols
# (:class:`~arraykv.caches.LayeredCache`, :class:`~arraykv.caches.HybridCache`); their
# methods take these docstrings (:func:`contract_doc`), which are the contract's one statement.


class IncrementalKVCache(Protocol):
    """A cache that stores without building a result and reads its keys and values back from a start.

    For a caller that keeps the reconstructed K/V of a layer between calls and asks only for
    what changed: after :meth:`append`, ``dequantize(layer, s)`` with ``s`` the previous
    :meth:`stable_length` gives the rows that are new or were reconstructed differently;
    the rows before ``s`` are those the caller holds already, bit for bit.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def append(self, layer: int, k: Array, v: Array, q: Array) -> None:
        """Store ``new_tokens`` keys and values exactly as ``prefill`` does, returning nothing.

        For callers that read the stored K/V back incrementally (``stable_length``,
        ``dequantize`` with ``start``), so that nothing is reconstructed that they already
        hold. Same parameters, checks and errors as ``prefill``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, new_tokens, head_dim)
            Keys (after RoPE) and values of the new tokens.
        q : array, shape (batch, q_heads, new_tokens, head_dim)
            Queries of the new tokens.
        """
        ...

    def stable_length(self, layer: int) -> int:
        """Leading tokens of ``layer`` whose reconstruction will not change as tokens are added.

        A token held exactly in a recent-token window, or a key waiting for its quantization
        group to fill, is reconstructed differently once it is encoded; tokens before this
        index are encoded for good (or never will be). ``dequantize(layer)[..., :s, :]`` with
        ``s = stable_length(layer)`` stays the same, bit for bit, whatever is stored later,
        until ``reset`` or a ``truncate`` below it. 0 for an empty layer, and always 0 for a
        sliding-window layer, whose oldest rows leave as tokens arrive.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            The number of leading tokens encoded for good, ``0 <= s <= seq_len(layer)``.
        """
        ...

    @property
    def rewrites(self) -> int:
        """How many times the cache's tokens were changed other than by storing new ones.

        Counts every ``reset``, ``truncate`` / ``truncate_all`` that dropped tokens, transaction
        rolled back, ``restore`` and ``select_rows``; a store that adds tokens (or a store
        refused and put back as it was) does not count. A caller that keeps what it read of a
        layer (its K/V up to ``seq_len``) may reuse it only while both ``seq_len`` and this
        count are what they were when it read: a cache truncated and extended again by
        someone else has the old length and other contents.

        Returns
        -------
        int
            Non-decreasing; 0 for a new cache.
        """
        ...

    def dequantize(self, layer: int, start: int = 0) -> DequantResult | None:
        """K/V of the tokens ``start ..`` stored in ``layer``, reconstructed, without storing anything.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        start : int, default 0
            First token returned, ``0 <= start <= seq_len``: skips tokens a caller already
            holds (the codes before it are not decoded). A sliding-window layer holds only its
            last positions and refuses a ``start`` before them.

        Returns
        -------
        DequantResult or None
            ``k``, ``v`` of shape ``(batch, kv_heads, total - start, head_dim)`` in the stored
            dtype; None for an empty layer.
        """
        ...


class TruncatableKVCache(Protocol):
    """A cache that takes tokens back from the end of its layers, exactly.

    A truncated layer is the layer a direct build would hold: the same calls replayed with the
    cut tokens left out. How far back a layer can go depends on what it keeps for it (its
    ``rollback_tokens`` copies, its calibration): :meth:`can_truncate` and
    :meth:`min_truncate_length` say so before :meth:`truncate` is asked. Speculative decoding
    and transformers' ``crop`` take a rejected draft back this way.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def truncate(self, layer: int, length: int) -> None:
        """Drop the tokens of ``layer`` from index ``length`` on, exactly.

        Afterwards ``seq_len``, ``dequantize``, ``stable_length``, what later calls return and
        the saved arrays are those of the same calls replayed without the dropped tokens.
        ``length == seq_len`` changes nothing; ``length == 0`` empties the layer (always
        possible).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        length : int
            ``0``, ``min_truncate_length(layer) <= length <= seq_len(layer)``, or a shorter
            length ``can_truncate`` accepts.

        Raises
        ------
        TypeError
            ``layer`` or ``length`` not an int.
        ValueError
            Out of range, or not reachable exactly; the message names the lengths reachable.
            Nothing changes.
        """
        ...

    def can_truncate(self, layer: int, length: int) -> bool:
        """Whether ``truncate`` of ``layer`` to ``length`` would succeed now (exactly).

        True for 0, for ``seq_len(layer)`` and every length from ``min_truncate_length`` up,
        and for the shorter lengths that are reachable; False above ``seq_len``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        length : int
            The length to reach, ``>= 0``.

        Returns
        -------
        bool
            Whether ``truncate(layer, length)`` would succeed now.

        Raises
        ------
        TypeError
            ``layer`` or ``length`` not an int.
        ValueError
            ``layer`` out of range or ``length`` negative.
        """
        ...

    def min_truncate_length(self, layer: int) -> int:
        """The smallest length ``L`` above 0 from which ``truncate`` reaches every length up to ``seq_len(layer)``.

        0 is always reachable too; ``seq_len`` when no shorter length is reachable from the
        top; 0 for an empty layer. Some lengths below ``L`` may be reachable as well:
        ``can_truncate`` answers for one length.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            ``L``, ``0 <= L <= seq_len(layer)``.
        """
        ...

    def truncate_all(self, length: int) -> None:
        """Truncate every layer holding more than ``length`` tokens to ``length`` (all or none).

        Every layer is checked before any changes; layers holding ``length`` tokens or fewer
        are left as they are. ``truncate_all(0)`` empties the cache like ``reset``.

        Parameters
        ----------
        length : int
            Tokens every layer keeps at most, ``0 <= length <=`` the longest layer's ``seq_len``.

        Raises
        ------
        ValueError
            ``length`` above every layer's ``seq_len``, or a layer that cannot reach it
            exactly; nothing changes.
        """
        ...


class KVTransaction(Protocol):
    """An open all-or-nothing group of calls on a cache (what ``begin_transaction`` returns).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.

    Attributes
    ----------
    open : bool
        True until :meth:`commit` or :meth:`rollback` ended it.
    """

    @property
    def open(self) -> bool:
        """True until :meth:`commit` or :meth:`rollback`."""
        ...

    def commit(self) -> None:
        """Keep what the calls did; the transaction ends."""
        ...

    def rollback(self) -> None:
        """Put every layer changed since the transaction began back exactly as it was; it ends."""
        ...


class TransactionalKVCache(Protocol):
    """A cache whose calls on several layers can take effect together or not at all.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def transaction(self) -> contextlib.AbstractContextManager[KVTransaction]:
        """Calls on several layers that take effect together or not at all.

        Inside ``with cache.transaction():`` every layer is recorded just before a call first
        changes it; when the block raises anything (an exception, ``KeyboardInterrupt``,
        ``MemoryError``), every layer it changed is put back exactly as it was, with the
        cache-wide state made meanwhile, and the exception goes on. Any number of tokens, any
        layer. Transactions nest (an inner one rolls back to its own start). A transaction
        holds the calls of the thread that began it.

        Returns
        -------
        context manager of KVTransaction
            Yields the transaction; its ``commit()`` or ``rollback()`` ends it early, and the
            block's end then does nothing.
        """
        ...

    def begin_transaction(self) -> KVTransaction:
        """Begin a ``transaction`` to end by hand (``commit()`` or ``rollback()``).

        For a caller whose calls do not nest in one block (transformers calls a cache's
        ``update`` once per layer).

        Returns
        -------
        KVTransaction
            Open until its ``commit()`` or ``rollback()``.
        """
        ...


class SnapshotKVCache(Protocol):
    """A cache that can say how it was made and copy out, or take back, its whole state.

    What saving (:func:`arraykv.persist.save_cache`), loading and the prefix store need:
    ``make_cache(**cache.get_config())`` builds an empty twin, and ``twin.restore(
    cache.snapshot())`` makes it hold what ``cache`` holds.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments that rebuild this cache: ``make_cache(**cfg)`` (method included).

        Returns
        -------
        dict
            ``method``, the geometry and the method's own options (JSON-serializable).
        """
        ...

    def snapshot(self, *, host: bool = False) -> list[Any]:
        """Copies of every layer's state, one consistent state taken under every layer's lock.

        Parameters
        ----------
        host : bool, default False
            Copy the arrays to NumPy arrays on the host instead of the cache's namespace.

        Returns
        -------
        list of LayerRecord or None
            ``num_layers`` entries, in layer order; None for an empty layer, else a
            :class:`~arraykv.storage.cache_file.LayerRecord`.
        """
        ...

    def restore(self, layers: list[Any], *, xp: Namespace | None = None) -> None:
        """Replace the state of every layer by ``layers`` (from ``snapshot`` or a cache file).

        Every layer is checked and rebuilt before any is replaced: on an error (a
        ``ValueError`` naming what does not fit) the cache is unchanged.

        Parameters
        ----------
        layers : list
            ``num_layers`` entries, each None or a ``LayerRecord``.
        xp : namespace, optional
            Namespace of the restored arrays; default: that of the arrays given.
        """
        ...


class BatchRowsKVCache(Protocol):
    """A cache whose batch rows can be reordered, repeated or selected (beam search).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def select_rows(self, indices: Any) -> None:
        """Keep, in every layer, the batch rows ``indices`` in that order.

        Reorder, repeat or select rows; every layer changes or, on a refusal or failure, none
        does.

        Parameters
        ----------
        indices : sequence of int or 1-D integer array
            Row numbers, each ``0 <= i < batch``; repeats allowed.
        """
        ...

    def batch_size(self) -> int:
        """The batch of the stored tokens (0 for an empty cache).

        Returns
        -------
        int
            The batch every layer holding tokens has.
        """
        ...


class LayerRoutedKVCache(Protocol):
    """A cache made of parts, each serving some of the layers (a hybrid model's global and sliding layers).

    A caller that treats layers by their kind (prompt staging) asks for the part that serves
    a layer and asks that part about its capabilities.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def cache_of(self, layer: int) -> CompressedKVCache:
        """The part that serves ``layer`` (it keeps the model's layer indices).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        CompressedKVCache
            The part; ``cache_of(layer).seq_len(layer)`` is ``seq_len(layer)``.
        """
        ...


class WindowTailKVCache(Protocol):
    """A sliding-window cache that holds the last ``keep`` positions and takes a long prompt by its tail.

    Prompt staging keeps only the last ``keep`` positions of a window layer's prompt and stores
    them in one call; a window cache without :meth:`append_last` cannot be staged.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.

    Attributes
    ----------
    keep : int
        Rows a layer holds after a call: the window plus the rollback margin.
    """

    keep: int

    def append_last(self, layer: int, k: Array, v: Array, q: Array, tokens: int) -> None:
        """Store ``tokens`` new tokens of which only the last ones are given.

        ``k``, ``v`` (and ``q``) are the last ``min(tokens, keep)`` tokens or more; the layer's
        ``seq_len`` grows by ``tokens``. The same checks and errors as ``append``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, given, head_dim)
            Keys (after RoPE) and values of the last ``given`` of the new tokens,
            ``min(tokens, keep) <= given <= tokens``.
        q : array, shape (batch, q_heads, given, head_dim)
            Queries of the same tokens.
        tokens : int
            New tokens in all, given or not.
        """
        ...


class PrefillTarget(Protocol):
    """What a prompt's layers are stored into: a cache, or a stand-in that forwards to one.

    The two contract methods a prompt run needs (``seq_len`` and ``prefill``, as
    :class:`CompressedKVCache` declares them). Every cache is one; so are the stand-ins an engine
    passes in a cache's place while a prompt runs (the prompt stage of
    ``arraykv.integrations.common.prompt_stage``, a draft's tee). Not a capability of a cache
    (:data:`CAPABILITIES` lists those): :data:`PREFILL_TARGET` lets :func:`supports` tell a target
    from something else.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def seq_len(self, layer: int) -> int:
        """Tokens stored in ``layer`` (see :meth:`CompressedKVCache.seq_len`).

        Parameters
        ----------
        layer : int
            Layer index.

        Returns
        -------
        int
        """
        ...

    def prefill(self, layer: int, k: Array, v: Array, q: Array) -> DequantResult:
        """Store a chunk of ``layer``'s tokens (see :meth:`CompressedKVCache.prefill`).

        Parameters
        ----------
        layer : int
            Layer index.
        k, v : array, shape (batch, kv_heads, t, head_dim)
        q : array, shape (batch, q_heads, t, head_dim)

        Returns
        -------
        DequantResult
        """
        ...


# -- asking a cache what it supports ------------------------------------------------------------


class Capability(Generic[_P]):
    """One of the protocols above, as something :func:`supports` can be asked about.

    Parameters
    ----------
    name : str
        Short name (``"truncation"``), what :func:`capabilities` lists.
    protocol : type
        The protocol class; :func:`supports` narrows a cache to it for a type checker.

    Attributes
    ----------
    members : tuple of str
        The names the protocol declares (methods, properties and attributes).
    """

    def __init__(self, name: str, protocol: type) -> None:
        self.name = name
        self.protocol = protocol
        self.members = tuple(
            n
            for n in (*vars(protocol), *getattr(protocol, "__annotations__", {}))
            if not n.startswith("_") and n not in _PROTOCOL_ATTRS
        )
        #: The answer of :func:`supports` per class of cache, found on first asking.
        self._answers: dict[type, bool | None] = {}

    def __repr__(self) -> str:
        return f"Capability({self.name!r}, {self.protocol.__name__})"


#: What every ``typing.Protocol`` class holds besides its members.
_PROTOCOL_ATTRS = frozenset(vars(Protocol)) | {"__doc__", "__module__", "__qualname__"}


def _class_answer(cls: type, capability: Capability) -> bool | None:
    """What ``cls`` itself says of ``capability``: True or False, or None where a member is not on
    the class (set on its instances, or forwarded by a ``__getattr__``): then each object decides."""
    for name in capability.members:
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is None:
            return None
        if vars(owner)[name] is None or getattr(owner, "_is_protocol", False):
            return False  # refused by its class, or only the protocol's empty declaration inherited
    return True


def _instance_answer(obj: object, capability: Capability) -> bool:
    """Whether every member of ``capability`` is on ``obj`` (looked up on the object, as hasattr does)."""
    cls = type(obj)
    for name in capability.members:
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is not None and (vars(owner)[name] is None or getattr(owner, "_is_protocol", False)):
            return False
        if getattr(obj, name, None) is None:
            return False
    return True


def supports(obj: object, capability: Capability[_P]) -> TypeGuard[_P]:
    """Whether ``obj`` has ``capability``: every member of its protocol, implemented.

    The answer is found once per class and then looked up: a dictionary read, cheap enough for
    a decode step's every layer. A class has a capability when it or a base defines every
    member of the protocol (a method the class sets to None is refused; a protocol's own empty
    declaration, inherited by subclassing it, does not count). Where a member is not on the
    class (an attribute set on instances, or a wrapper forwarding through ``__getattr__``),
    each object is asked, as ``hasattr`` would, so one wrapped cache never answers for another.
    The built-in caches also declare their capabilities by subclassing the protocols
    (:func:`declares`), which a test holds equal to this answer.

    Parameters
    ----------
    obj : object
        A cache, or anything.
    capability : Capability
        One of :data:`CAPABILITIES`.

    Returns
    -------
    bool
        True when ``obj`` has it (and, for a type checker, ``obj`` is then of its protocol).

    Examples
    --------
    >>> import arraykv
    >>> from arraykv.protocol import TRUNCATION, WINDOW_TAIL, supports
    >>> cache = arraykv.make_cache("pqo4", num_layers=2, num_kv_heads=1, head_dim=64)
    >>> supports(cache, TRUNCATION), supports(cache, WINDOW_TAIL)
    (True, False)
    """
    cls = type(obj)
    try:
        answer = capability._answers[cls]
    except KeyError:
        answer = capability._answers[cls] = _class_answer(cls, capability)
    return _instance_answer(obj, capability) if answer is None else answer


def declares(cls: type, capability: Capability) -> bool:
    """Whether ``cls`` declares ``capability`` by subclassing its protocol.

    Parameters
    ----------
    cls : type
        A cache class.
    capability : Capability
        One of :data:`CAPABILITIES`.

    Returns
    -------
    bool
        True when the protocol is among the bases of ``cls`` (its method resolution order).
    """
    return capability.protocol in cls.__mro__


def capabilities(obj: object) -> tuple[str, ...]:
    """The names of the capabilities ``obj`` has, in the order of :data:`CAPABILITIES`.

    Parameters
    ----------
    obj : object
        A cache, or anything.

    Returns
    -------
    tuple of str
        ``Capability.name`` of each capability :func:`supports` grants it.
    """
    return tuple(c.name for c in CAPABILITIES if supports(obj, c))


def contract_doc(source: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give the decorated method the docstring of the contract's ``source`` method.

    So that the contract is written once, in the protocols of this module, and an
    implementation that adds nothing to it says which one it implements.

    Parameters
    ----------
    source : callable
        A protocol's method (``TruncatableKVCache.truncate``).

    Returns
    -------
    callable
        A decorator that sets ``__doc__`` and returns the method itself (no wrapper, no cost).
    """

    def decorate(method: _F) -> _F:
        method.__doc__ = source.__doc__
        return method

    return decorate


#: The five methods of :class:`CompressedKVCache`.
KV_CACHE = Capability[CompressedKVCache]("kv_cache", CompressedKVCache)
#: ``append``, ``stable_length``, ``dequantize(layer, start)``: :class:`IncrementalKVCache`.
INCREMENTAL = Capability[IncrementalKVCache]("incremental", IncrementalKVCache)
#: ``truncate``, ``can_truncate``, ``min_truncate_length``, ``truncate_all``: :class:`TruncatableKVCache`.
TRUNCATION = Capability[TruncatableKVCache]("truncation", TruncatableKVCache)
#: ``transaction()``, ``begin_transaction()``: :class:`TransactionalKVCache`.
TRANSACTIONS = Capability[TransactionalKVCache]("transactions", TransactionalKVCache)
#: ``get_config``, ``snapshot``, ``restore``: :class:`SnapshotKVCache`.
SNAPSHOTS = Capability[SnapshotKVCache]("snapshots", SnapshotKVCache)
#: ``select_rows``, ``batch_size``: :class:`BatchRowsKVCache`.
BATCH_ROWS = Capability[BatchRowsKVCache]("batch_rows", BatchRowsKVCache)
#: ``cache_of``: :class:`LayerRoutedKVCache`.
LAYER_ROUTING = Capability[LayerRoutedKVCache]("layer_routing", LayerRoutedKVCache)
#: ``keep``, ``append_last``: :class:`WindowTailKVCache`.
WINDOW_TAIL = Capability[WindowTailKVCache]("window_tail", WindowTailKVCache)
#: ``seq_len``, ``prefill``: :class:`PrefillTarget` (a cache or a stand-in; not in :data:`CAPABILITIES`).
PREFILL_TARGET = Capability[PrefillTarget]("prefill_target", PrefillTarget)

#: Every capability, in the order :func:`capabilities` lists them.
CAPABILITIES: tuple[Capability, ...] = (
    KV_CACHE,
    INCREMENTAL,
    TRUNCATION,
    TRANSACTIONS,
    SNAPSHOTS,
    BATCH_ROWS,
    LAYER_ROUTING,
    WINDOW_TAIL,
)
