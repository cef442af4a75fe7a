"""The machinery every cache shares: per-layer locks, validation and bookkeeping.

A concrete cache subclasses :class:`LayeredCache` and implements hooks that run with the
layer's lock held and only after every input check passed:

``_new_layer(xp, dev, batch, dtype)``
    Create the state of a layer on its first call.
``_store(state, k, v, q)``, ``_decoded(state, start)``
    Store new tokens; K/V of the stored tokens from ``start`` on. ``append`` and
    ``dequantize`` use them as they are; ``_prefill`` and ``_decode`` build on them.
``_prefill(state, k, v, q)``, ``_decode(state, k, v, q, config)``
    Store and return a :class:`~arraykv.DequantResult` / :class:`~arraykv.Fused` or
    :class:`~arraykv.Dequantized`.
``_side_nbytes(state)``, ``_side_spare_nbytes(state)``
    Bytes held besides the token buffers of ``state.buffers()``, and spare room beside them.
``_truncate_plan(state, length)``, ``_truncate_floor(state)``, ``_reachable(state, length)``, ``_reach_ranges(state)``
    Drop tokens from the end, and which lengths can be reached (:mod:`arraykv.caches.rollback`).
``_layer_arrays(state)``, ``_layer_layout(xp, batch, dtype, length)``, ``_restore_layer(...)``
    A layer as named arrays, what such arrays must be (:mod:`arraykv.caches.layout`), and the
    layer rebuilt from checked ones (:mod:`arraykv.caches.snapshots`).

Hooks must compute everything that can fail before they mutate ``state`` so that a rejected
call leaves the layer as it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from .. import _compat
from .._types import Array, Device, DType, Namespace
from .._validation import check_bool, check_finite, check_int, check_kv, check_query, dtype_name
from ..protocol import (
    AttendConfig,
    BatchRowsKVCache,
    CompressedKVCache,
    DecodeOutput,
    DequantResult,
    IncrementalKVCache,
    SnapshotKVCache,
    TransactionalKVCache,
    TruncatableKVCache,
    contract_doc,
)
from .batch_rows import LayerBatchRows
from .layer import DECODE_PATHS, LayerState, check_decode_path, refuse_overflow
from .layout import Layout
from .rollback import LayerRollback
from .snapshots import LayerSnapshots
from .transaction import CacheTransaction, LayerUndo, checkpoint

__all__ = ["LayeredCache", "LayerState", "refuse_overflow", "check_decode_path", "DECODE_PATHS"]


#: ``(xp, shape)`` of the NumPy input signatures that passed :meth:`LayeredCache._check_inputs`.
_CHECKED_NUMPY: dict[tuple, tuple[Namespace, tuple[int, ...]]] = {}

_T = TypeVar("_T")
#: The layer state of a cache class (:class:`LayerState` or a subclass).
_S = TypeVar("_S", bound=LayerState)


class LayeredCache(
    LayerSnapshots[_S],
    LayerRollback[_S],
    LayerBatchRows[_S],
    CompressedKVCache,
    IncrementalKVCache,
    TruncatableKVCache,
    TransactionalKVCache,
    SnapshotKVCache,
    BatchRowsKVCache,
):
    """Base class of the caches: a lock and a state per layer.

    Parameters
    ----------
    num_layers : int
        Transformer layers; valid layer indices are ``0 .. num_layers - 1``.
    num_kv_heads : int
        KV heads per layer.
    head_dim : int
        Channels per head.
    check_finite : bool, default True
        Reject keys and values that hold NaN or infinity (one pass over the new tokens).
    max_tokens : int or None, default None
        Tokens a layer may hold; a call that would exceed it raises ``ValueError``.

    Notes
    -----
    Besides the contract, the capabilities of :mod:`arraykv.protocol` it declares by its bases
    (the protocols' docstrings state them): incremental reading
    (:class:`~arraykv.protocol.IncrementalKVCache`: :meth:`append`, :meth:`stable_length`,
    :meth:`dequantize`), transactions (:class:`~arraykv.protocol.TransactionalKVCache`),
    persistence (:class:`~arraykv.protocol.SnapshotKVCache`, implemented by
    :class:`~arraykv.caches.snapshots.LayerSnapshots`: ``get_config``, ``snapshot``,
    ``restore``, and ``save``), taking tokens back
    (:class:`~arraykv.protocol.TruncatableKVCache`, implemented by
    :class:`~arraykv.caches.rollback.LayerRollback` with ``rollback_bytes`` and ``fork``), and
    reordering, repeating or selecting batch rows (:class:`~arraykv.protocol.BatchRowsKVCache`,
    implemented by :class:`~arraykv.caches.batch_rows.LayerBatchRows`).
    """

    method: str = "base"
    #: Whether the tokens are held as given (no compression), so that a long prompt needs no
    #: exact staging while it runs (:mod:`arraykv.integrations.common.prompt_stage`).
    stores_exactly: bool = False

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        check_finite: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        self.num_layers = check_int("num_layers", num_layers, low=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, low=1)
        self.head_dim = check_int("head_dim", head_dim, low=1)
        self.check_finite = check_bool("check_finite", check_finite)
        self.max_tokens = None if max_tokens is None else check_int("max_tokens", max_tokens, low=1)
        self._locks = [threading.Lock() for _ in range(self.num_layers)]
        self._states: list[_S | None] = [None] * self.num_layers
        #: Open transactions by the thread that began them, outermost first (:meth:`transaction`).
        self._transactions: dict[int, list[CacheTransaction]] = {}
        self._rewrites = 0  # see the rewrites property

    # -- the contract ------------------------------------------------------------
    @contract_doc(CompressedKVCache.prefill)
    def prefill(self, layer: int, k: Array, v: Array, q: Array) -> DequantResult:
        layer = self._check_layer(layer)
        xp, shape = self._check_inputs(k, v, q)
        with self._locks[layer]:
            state = self._admit(layer, xp, k, v, shape[2])
            with self._taking_back(layer, state, shape[2]):
                result = self._prefill(state, k, v, q)
            return result

    @contract_doc(IncrementalKVCache.append)
    def append(self, layer: int, k: Array, v: Array, q: Array) -> None:
        layer = self._check_layer(layer)
        xp, shape = self._check_inputs(k, v, q)
        with self._locks[layer]:
            state = self._admit(layer, xp, k, v, shape[2])
            with self._taking_back(layer, state, shape[2]):
                self._append_tokens(state, k, v, q)

    @contract_doc(IncrementalKVCache.stable_length)
    def stable_length(self, layer: int) -> int:
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            return 0 if st is None else self._stable_length(st)

    @contract_doc(CompressedKVCache.decode)
    def decode(self, layer: int, k: Array, v: Array, q: Array, config: AttendConfig) -> DecodeOutput:
        layer = self._check_layer(layer)
        if not isinstance(config, AttendConfig):
            raise TypeError(f"config must be an AttendConfig, received {type(config).__name__}")
        xp, shape = self._check_inputs(k, v, q)
        if shape[2] != 1:
            raise ValueError(f"decode takes exactly one new token (k axis 2), received {shape[2]}")
        groups = int(q.shape[1]) // shape[1]
        if groups != config.n_kv_groups:
            raise ValueError(
                f"config.n_kv_groups must equal q_heads // kv_heads = {groups}, received {config.n_kv_groups}"
            )
        with self._locks[layer]:
            state = self._admit(layer, xp, k, v, 1)
            record = self._call_record(layer, state)  # _taking_back, spelt out (a step's every microsecond)
            try:
                out = self._decode(state, k, v, q, config)
                self._commit(layer, state, 1)
            except BaseException:
                self._put_back(layer, state, record)
                raise
            return out

    @property
    def rewrites(self) -> int:
        """Changes other than stores of new tokens so far (see
        :attr:`arraykv.protocol.IncrementalKVCache.rewrites`)."""
        return self._rewrites

    @contract_doc(CompressedKVCache.seq_len)
    def seq_len(self, layer: int) -> int:
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            return 0 if st is None else st.length

    def reset(self) -> None:
        """Forget every token of every layer (takes all layer locks, in order).

        Inside a :meth:`transaction` the layers are recorded first, so a rollback brings
        them back."""
        with self._all_layers_locked():
            self._note_every_layer()
            self._states = [None] * self.num_layers
            self._on_reset()
            self._rewrites += 1

    # -- transactions (arraykv.caches.transaction) ----------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[CacheTransaction]:
        """Calls on several layers that take effect together or not at all.

        As :meth:`arraykv.protocol.TransactionalKVCache.transaction` states it: a layer's
        lengths, arrays, calibration, windows and rollback copies are put back, with the
        cache-wide state (rotations, codebooks); not bounded by ``rollback_tokens``.

        Yields
        ------
        CacheTransaction
            Its ``commit()`` or ``rollback()`` ends it early; the block's end then does nothing.

        Notes
        -----
        Cost: one undo record per layer changed (:mod:`arraykv.caches.transaction`). The
        built-in global caches (``dense``, ``int*``, ``pq*``/``pqo*``/``tq*``, ``lowrank``,
        ``vq``) keep their fields by reference and copy only their float16 windows and
        rollback copies (tens of rows); a window cache's layer is copied (its window). A
        :meth:`truncate` inside a transaction also copies the rows that the layer's records
        share with it. :meth:`restore` and :meth:`fork` are outside any transaction.

        Examples
        --------
        >>> import numpy as np, arraykv
        >>> cache = arraykv.make_cache("pqo4", num_layers=2, num_kv_heads=1, head_dim=64)
        >>> x = np.ones((1, 1, 40, 64), np.float32)
        >>> try:
        ...     with cache.transaction():
        ...         _ = cache.prefill(0, x, x, x)
        ...         raise KeyboardInterrupt  # before layer 1 got its tokens
        ... except KeyboardInterrupt:
        ...     pass
        >>> cache.seq_len(0), cache.seq_len(1)
        (0, 0)
        """
        txn = self.begin_transaction()
        try:
            yield txn
        except BaseException:
            txn.rollback()
            raise
        txn.commit()

    @contract_doc(TransactionalKVCache.begin_transaction)
    def begin_transaction(self) -> CacheTransaction:
        with self._all_layers_locked():
            txn = CacheTransaction(self, self._fixed_record())
            self._transactions.setdefault(txn.owner, []).append(txn)
            return txn

    def _end_transaction(self, txn: CacheTransaction, *, commit: bool) -> None:
        """Commit or roll back ``txn`` and the transactions begun inside it (all locks held)."""
        with self._all_layers_locked():
            if not txn.open:
                return
            stack = self._transactions.get(txn.owner, [])
            while stack:
                top = stack.pop()
                top.open = False
                if not commit:
                    for layer, record in top.records.items():
                        self._states[layer] = record.restore()
                    self._restore_fixed(top.fixed)
                    self._rewrites += 1
                top.records = {}
                if top is txn:
                    break
            if not stack:
                self._transactions.pop(txn.owner, None)

    def _fixed_record(self) -> Any:
        """The cache-wide state a rollback puts back: a copy of the ``_fixed`` dict (rotations,
        codebooks made on first use), or None for a cache without one."""
        fixed = getattr(self, "_fixed", None)
        return dict(fixed) if isinstance(fixed, dict) else None

    def _restore_fixed(self, record: Any) -> None:
        if record is not None:
            self._fixed = dict(record)

    def _checkpoint(self, state: _S | None) -> LayerUndo:
        """The undo record of a layer now (:func:`arraykv.caches.transaction.checkpoint`)."""
        return checkpoint(state, self._copy_layer)

    def _note(self, layer: int, *, truncating: bool = False) -> LayerUndo | None:
        """Record ``layer`` in every open transaction of this thread that has no record of it
        (its lock held); the record made, else None. ``truncating``: a truncation follows, so
        the layer's records (every thread's) stop sharing rows with it first."""
        if not self._transactions:
            return None
        if truncating:
            for stack in list(self._transactions.values()):
                for txn in stack:
                    record = txn.records.get(layer)
                    if record is not None:
                        record.detach()
        mine = self._transactions.get(threading.get_ident())
        if not mine:
            return None
        made = None
        for txn in mine:
            if layer not in txn.records:
                if made is None:
                    made = self._checkpoint(self._states[layer])
                    if truncating:
                        made.detach()
                txn.records[layer] = made
        return made

    def _note_every_layer(self) -> None:
        """:meth:`_note` of every layer (all locks held), before a change to all of them."""
        for i in range(self.num_layers):
            self._note(i)

    def reallocations(self) -> int:
        """Times any layer's token buffers were reallocated to grow (amortized growth check).

        Returns
        -------
        int
            Reallocations summed over every buffer of every layer.
        """
        total = 0
        with self._all_layers_locked():
            for st in self._states:
                if st is not None:
                    total += sum(b.reallocations for b in st.buffers())
        return total

    @contextlib.contextmanager
    def _all_layers_locked(self) -> Iterator[None]:
        for lock in self._locks:
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(self._locks):
                lock.release()

    def memory_usage(self) -> int:
        """Bytes the cache holds: every layer's buffers, spare capacity included, plus fixed state.

        Buffers are sized exactly on prefill and grow in bounded steps on decode (at most
        ``1.1 × used + 64`` tokens each, :class:`~arraykv.storage.TokenBuffers`), so this
        exceeds :meth:`used_bytes` by at most that spare room.

        Returns
        -------
        int
            Bytes allocated over all layers, plus the fixed state.
        """
        return self._sum_layers(self._layer_reserved_nbytes)

    def used_bytes(self) -> int:
        """Bytes of the state of the stored tokens, plus fixed state (spare capacity and the
        rollback copies kept for :meth:`truncate`, :meth:`rollback_bytes`, not counted).

        What bits per value are computed from: ``8 · used_bytes() / values stored``. The
        rollback copies are a fixed margin of ``rollback_tokens`` tokens per layer, not part of
        how the tokens are stored; :meth:`memory_usage` counts them.

        Returns
        -------
        int
            Bytes over all layers, plus the fixed state.
        """
        return self._sum_layers(lambda st: self._layer_nbytes(st) - self._rollback_nbytes(st))

    def _sum_layers(self, per_layer: Callable[[_S], int]) -> int:
        total = self._fixed_nbytes()
        for i, lock in enumerate(self._locks):
            with lock:
                st = self._states[i]
                if st is not None:
                    total += per_layer(st)
        return total

    @contract_doc(IncrementalKVCache.dequantize)
    def dequantize(self, layer: int, start: int = 0) -> DequantResult | None:
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            if st is None:
                if start != 0:
                    check_int("start", start, low=0, high=0)
                return None
            start = check_int("start", start, low=0, high=st.length)
            return self._dequantize(st) if start == 0 else self._dequantize_from(st, start)

    def layer_arrays(self, layer: int) -> dict[str, Array]:
        """Copies of the raw arrays that ``layer`` holds (codes, norms, buffers), by name.

        Empty for an empty layer. Two snapshots are equal exactly when the stored state is.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        dict of str to array
            The arrays, copied, in the layer's namespace.
        """
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            if st is None:
                return {}
            return {name: st.xp.asarray(a, copy=True) for name, a in self._layer_arrays(st).items()}

    def _with_layer(self, layer: int, read: Callable[[_S], _T]) -> _T | None:
        """``read(state)`` under ``layer``'s lock, or None for an empty layer (for inspection methods)."""
        layer = self._check_layer(layer)
        with self._locks[layer]:
            st = self._states[layer]
            return None if st is None else read(st)

    def reserved_bytes(self) -> int:
        """Bytes allocated, spare capacity included: the same as :meth:`memory_usage`.

        Returns
        -------
        int
            :meth:`memory_usage`.
        """
        return self.memory_usage()

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments that rebuild this cache: ``make_cache(**cfg)`` (method included).

        Returns
        -------
        dict
            ``method``, the geometry, ``check_finite``, ``max_tokens`` and the method's own
            options (JSON-serializable).
        """
        cfg = {
            "method": self.method,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "check_finite": self.check_finite,
            "max_tokens": self.max_tokens,
        }
        cfg.update(self._extra_config())
        return cfg

    # -- shared checks -----------------------------------------------------------
    def _check_layer(self, layer: int) -> int:
        return check_int("layer", layer, low=0, high=self.num_layers - 1)

    def _check_inputs(self, k: Array, v: Array, q: Array) -> tuple[Namespace, tuple[int, ...]]:
        """``(xp, shape)`` of checked ``k``, ``v``, ``q`` (:func:`check_kv`, :func:`check_query`).

        For plain NumPy arrays the checks depend only on the shapes and dtypes, so a signature
        that passed once is looked up instead of checked again (a decode step passes the same
        one every call).
        """
        numpy_key = None
        if _compat.plain_numpy(k, v, q):
            numpy_key = (self.num_kv_heads, self.head_dim, k.shape, v.shape, q.shape, k.dtype, v.dtype, q.dtype)
            hit = _CHECKED_NUMPY.get(numpy_key)
            if hit is not None:
                return hit
        xp, shape = check_kv(k, v, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        check_query(q, xp, shape, device=_compat.device(k))
        if numpy_key is not None and len(_CHECKED_NUMPY) < 1024:
            _CHECKED_NUMPY[numpy_key] = (xp, shape)
        return xp, shape

    def _admit(self, layer: int, xp: Namespace, k: Array, v: Array, tokens: int) -> _S:
        """Check the call against the layer's state (under its lock); create the state if new."""
        st = self._states[layer]
        batch = int(k.shape[0])
        dev = _compat.device(k)
        if st is not None:
            if st.xp is not xp:
                raise TypeError(f"layer {layer} holds arrays of another library; reset the cache to switch")
            if st.device != dev:
                raise ValueError(f"k must be on device {st.device} like the stored tokens, received {dev}")
            if st.batch != batch:
                raise ValueError(f"k must have batch {st.batch} like the stored tokens, received {batch}")
            if st.dtype != k.dtype:
                raise TypeError(
                    f"k must have dtype {dtype_name(st.dtype)} like the stored tokens, received {dtype_name(k.dtype)}"
                )
        if self.max_tokens is not None:
            held = 0 if st is None else st.length
            if held + tokens > self.max_tokens:
                raise ValueError(
                    f"layer {layer} holds {held} tokens and max_tokens is {self.max_tokens}; {tokens} more do not fit"
                )
        if self.check_finite and not (tokens == 1 and st is not None and self._store_refuses_nonfinite(st, k)):
            check_finite(xp, k=k, v=v)
        if st is None:
            st = self._new_layer(xp, dev, batch, k.dtype)
        return st

    def _store_refuses_nonfinite(self, state: _S, k: Array) -> bool:
        """Whether the store of the one token ``k`` into ``state`` refuses non-finite keys and
        values itself, with :func:`~arraykv._validation.check_finite`'s error (before it
        changes anything), so that :meth:`_admit` need not look at them first. Default False."""
        return False

    def _commit(self, layer: int, state: _S, tokens: int) -> None:
        state.length += tokens
        state.stored = False
        self._states[layer] = state

    def _store_tokens(self, state: _S, k: Array, v: Array, q: Array) -> None:
        """:meth:`_store`, then mark the layer as holding the call's tokens (see :meth:`_taking_back`)."""
        self._store(state, k, v, q)
        state.stored = True

    @contextlib.contextmanager
    def _taking_back(self, layer: int, state: _S, tokens: int) -> Iterator[None]:
        """Run a call that stores ``tokens`` in ``layer`` and count them, or put the layer back
        exactly as it was when it fails anywhere (lock held).

        A prefill or decode stores its tokens (all-or-nothing), then builds its result: float
        keys and values of the whole layer, or the attention; a failure there (a
        ``MemoryError`` reconstructing a long layer, an interrupt) would leave the buffers
        holding tokens that ``seq_len`` does not count. So the layer is recorded before the
        call (:mod:`arraykv.caches.transaction`: its fields, or a copy) and put back from the
        record on any failure, whatever the number of tokens. The same record serves the open
        transactions that had none of this layer yet. A new layer is simply not kept.
        """
        record = self._call_record(layer, state)
        try:
            yield
            self._commit(layer, state, tokens)
        except BaseException:
            self._put_back(layer, state, record)
            raise

    def _call_record(self, layer: int, state: _S) -> LayerUndo:
        """The undo record of a call on ``layer`` about to change ``state`` (see :meth:`_taking_back`)."""
        made = self._note(layer)
        if made is not None:
            return made
        return self._checkpoint(state if self._states[layer] is state else None)

    def _put_back(self, layer: int, state: _S, record: LayerUndo) -> None:
        """Undo a failed call on ``layer`` from its :meth:`_call_record`."""
        state.stored = False
        self._states[layer] = record.restore()

    # -- hooks -------------------------------------------------------------------
    def _new_layer(self, xp: Namespace, dev: Device, batch: int, dtype: DType) -> _S:
        return cast(_S, LayerState(xp=xp, device=dev, batch=batch, dtype=dtype))

    def _prefill(self, state: _S, k: Array, v: Array, q: Array) -> DequantResult:
        raise NotImplementedError

    def _decode(self, state: _S, k: Array, v: Array, q: Array, config: AttendConfig) -> DecodeOutput:
        raise NotImplementedError

    def _store(self, state: _S, k: Array, v: Array, q: Array) -> None:
        """Store new tokens (everything that can fail computed before anything changes)."""
        raise NotImplementedError

    def _decoded(self, state: _S, start: int = 0) -> DequantResult:
        """K/V of the stored tokens ``start ..`` in the layer's dtype (``0 <= start <= length``)."""
        raise NotImplementedError

    def _dequantize(self, state: _S) -> DequantResult:
        return self._decoded(state)

    def _dequantize_from(self, state: _S, start: int) -> DequantResult:
        return self._decoded(state, start)

    def _append_tokens(self, state: _S, k: Array, v: Array, q: Array) -> None:
        """Store tokens without building a result."""
        self._store(state, k, v, q)

    def _side_nbytes(self, state: _S) -> int:
        """Bytes a layer holds besides its token buffers (windows, calibration, rollback copies)."""
        return 0

    def _layer_nbytes(self, state: _S) -> int:
        return sum(b.used_nbytes() for b in state.buffers()) + self._side_nbytes(state)

    def _layer_reserved_nbytes(self, state: _S) -> int:
        return (
            sum(b.reserved_nbytes() for b in state.buffers())
            + self._side_nbytes(state)
            + self._side_spare_nbytes(state)
        )

    def _side_spare_nbytes(self, state: _S) -> int:
        """Bytes of spare room in what :meth:`_side_nbytes` counts (counted by :meth:`memory_usage` only)."""
        return 0

    def _stable_length(self, state: _S) -> int:
        """See :meth:`stable_length`; 0 (nothing promised) unless a cache knows better."""
        return 0

    #: How a cache with a fused decode answers ``decode`` (see :func:`check_decode_path`).
    decode_path: str = "auto"

    def _fused(self, xp: Namespace) -> bool:
        """Whether ``decode`` attends itself (:class:`~arraykv.Fused`) for namespace ``xp``."""
        if self.decode_path == "auto":
            return self._fused_auto(xp)
        return self.decode_path == "fused"

    def _fused_auto(self, xp: Namespace) -> bool:
        """The ``"auto"`` choice: whether attending from the stored form pays on ``xp``."""
        return False

    def _layer_arrays(self, state: _S) -> dict[str, Array]:
        raise NotImplementedError

    def _extra_config(self) -> dict[str, Any]:
        """Method-specific constructor options (JSON-serializable), for :meth:`get_config`."""
        return {}

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout | None:
        """The :class:`~arraykv.caches.layout.Layout` of the arrays a layer of ``batch``, ``dtype``
        and ``length`` tokens may hold, checked before :meth:`_restore_layer` builds anything;
        None for a cache whose ``_restore_layer`` checks its arrays itself."""
        return None

    def _restore_layer(
        self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
    ) -> _S:
        """Rebuild a layer's state from :meth:`_layer_arrays` output (used by persistence), after
        :meth:`_layer_layout` passed; arrays a layout does not cover must be checked here."""
        raise NotImplementedError

    def _fixed_nbytes(self) -> int:
        return 0

    def _on_reset(self) -> None:
        pass

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(method={self.method!r}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"
        )
