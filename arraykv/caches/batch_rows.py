"""Reordering, repeating and selecting a cache's batch rows: :class:`LayerBatchRows`, :func:`select_rows_of`.

A batch row is one sequence. Beam search keeps ``num_beams`` hypotheses per sequence as rows
and, after each step, continues the best ones: the new row ``i`` is the old row
``indices[i]`` (one old row may be continued by several beams, another by none).
``num_return_sequences`` after a prefill repeats each row, contrastive search keeps a subset.
All three are one operation, ``select_rows(indices)``: afterwards the cache holds, in every
layer, row ``indices[i]`` of before as its row ``i``; the batch becomes ``len(indices)``.

Which arrays have a batch axis. A layer's state is its named arrays
(:meth:`~arraykv.caches.LayeredCache._layer_arrays`: codes, norms, scales, the exact window
and sinks, calibration, rollback copies) and a cache describes them with its layout
(:meth:`~arraykv.caches.LayeredCache._layer_layout`, :mod:`arraykv.caches.layout`), whose
shapes give the batch as a number. To tell the batch axis from an axis that has the same size
(two KV heads in a batch of two), the layout is asked for a layer of a batch no real array has
(:data:`PROBE_BATCH`): the axes that come out as that number are the batch axes. Arrays
without one are shared by every row and kept as they are: a ``lowrank`` basis and ``vq``
codebooks (fitted on the tokens of every row), the ``int`` caches' power-of-two units, the
rotary channel pairs of a rotating key mean; so are the cache-wide rotations and codebooks,
and each layer's record of its calibrating call. Everything else is taken row by row
(``xp.take`` along the batch axis) and the layer is rebuilt from the taken arrays with the
cache's ``_restore_layer``, as :meth:`~arraykv.caches.LayeredCache.fork` copies a layer.

So a cache fed rows ``[a, b, c]`` and then given ``select_rows([2, 0, 0])`` holds, bit for
bit, what a cache fed ``[c, a, a]`` from the start holds, for every cache whose state is kept
per row (``dense``, ``int``, ``pq``/``pqo``/``tq``, the sliding windows); a ``lowrank`` or
``vq`` cache holds what a cache *given* the same fit and fed ``[c, a, a]`` holds.

Atomic and thread-safe: the caller's indices are checked first (1-D integers, at least one,
each inside every layer's batch), then every layer lock is taken in index order (for a
:class:`~arraykv.caches.HybridCache`: its global layers' cache, then its sliding layers'),
every new layer is built, and only then are they put in place; a failure on the way (a
``MemoryError`` copying a long layer, an interrupt) leaves the cache as it was. Inside a
:meth:`~arraykv.caches.LayeredCache.transaction` the layers are recorded before they are
replaced, so the transaction's rollback puts the rows back as they were.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .. import _compat
from .._types import Array, Device, DType, Namespace
from .layer import LayerState

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["LayerBatchRows", "check_rows", "select_rows_of", "PROBE_BATCH"]

#: The batch a layer's layout is asked for to find its arrays' batch axes: no real layer has
#: it, and no other size of a layout comes out as it.
PROBE_BATCH = 2**31 - 7

#: The layer state of a cache class (:class:`LayerState` or a subclass).
_S = TypeVar("_S", bound=LayerState)


def check_rows(indices: Any) -> list[int]:
    """``indices`` as a list of Python ints, checked for form (not yet against a batch).

    Parameters
    ----------
    indices : sequence of int or 1-D integer array
        A list, tuple or range of integers, or a 1-D integer array of any array library
        (NumPy, CuPy, a torch tensor).

    Returns
    -------
    list of int
        The row numbers, at least one, each ``>= 0``.

    Raises
    ------
    TypeError
        Not a sequence or 1-D array of integers (floats and booleans are refused).
    ValueError
        Empty, or a negative row number.
    """
    if isinstance(indices, (str, bytes)) or indices is None:
        raise TypeError(f"indices must be a sequence or 1-D array of row numbers, received {type(indices).__name__}")
    if hasattr(indices, "ndim") and hasattr(indices, "dtype"):  # an array of some library
        if indices.ndim != 1:
            raise ValueError(f"indices must be 1-D, received an array of shape {tuple(indices.shape)}")
        indices = _compat.to_numpy(indices).tolist()
    elif not isinstance(indices, Sequence):
        raise TypeError(f"indices must be a sequence or 1-D array of row numbers, received {type(indices).__name__}")
    rows = []
    for i, value in enumerate(indices):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"indices[{i}] must be an integer row number, received {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"indices[{i}] must be a row number >= 0, received {int(value)}")
        rows.append(int(value))
    if not rows:
        raise ValueError("indices must name at least one row (a cache holds a batch of at least 1)")
    return rows


class LayerBatchRows(Generic[_S]):
    """``select_rows`` and ``batch_size`` for a cache with ``_locks``, ``_states`` and the layer hooks."""

    if TYPE_CHECKING:  # what the cache class provides (:class:`~arraykv.caches.LayeredCache`)
        method: str
        num_layers: int
        _locks: list[threading.Lock]
        _states: list[_S | None]
        _rewrites: int

        def _all_layers_locked(self) -> contextlib.AbstractContextManager[None]: ...
        def _note_every_layer(self) -> None: ...
        def _layer_arrays(self, state: _S) -> dict[str, Array]: ...
        def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout | None: ...
        def _restore_layer(
            self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
        ) -> _S: ...

    def select_rows(self, indices: Any) -> None:
        """Keep, in every layer, the batch rows ``indices`` in that order (reorder, repeat, select).

        Afterwards row ``i`` of every layer is row ``indices[i]`` of before, and the batch is
        ``len(indices)``: ``[2, 0, 0]`` reorders and repeats (beam search), ``[0, 0, 1, 1]``
        repeats each row twice (``num_return_sequences``), ``[1]`` keeps one row. State shared
        by every row (a fitted basis or codebook, the int caches' units) is kept; see
        :mod:`arraykv.caches.batch_rows`. An empty cache is left as it is.

        Parameters
        ----------
        indices : sequence of int or 1-D integer array
            Row numbers, each ``0 <= i < batch``; repeats allowed.

        Raises
        ------
        TypeError
            ``indices`` not integers.
        ValueError
            Empty, 2-D, or a row number outside a layer's batch; nothing changes.
        NotImplementedError
            A cache whose layers do not describe their arrays (no ``_layer_layout``).

        Notes
        -----
        Cost: a copy of every layer's arrays (O(bytes held)), under every layer lock, taken
        in index order; the new layers are built before any replaces the old ones, so a
        failure leaves the cache as it was.
        """
        select_rows_of([self], indices)

    def batch_size(self) -> int:
        """The batch of the stored tokens: rows per layer (0 for an empty cache).

        Returns
        -------
        int
            The batch every layer holding tokens has.

        Raises
        ------
        ValueError
            Layers holding different batches (filled by separate calls of different batches).
        """
        with self._all_layers_locked():
            batches = {st.batch for st in self._states if st is not None}
        if len(batches) > 1:
            raise ValueError(f"the layers hold different batches {sorted(batches)}; no one batch size")
        return batches.pop() if batches else 0

    # -- internals (every layer lock held) ------------------------------------------------
    def _selected_states(self, rows: list[int]) -> list[_S | None]:
        """Every layer rebuilt with ``rows`` (checked against each layer's batch); nothing changes."""
        for i, st in enumerate(self._states):
            if st is not None and max(rows) >= st.batch:
                bad = next(r for r in rows if r >= st.batch)
                raise ValueError(
                    f"indices must be row numbers in [0, {st.batch}) (the batch of layer {i}), received {bad}"
                )
        return [None if st is None else self._layer_rows(st, rows) for st in self._states]

    def _layer_rows(self, st: _S, rows: list[int]) -> _S:
        """A new state of layer ``st`` holding ``rows`` (its arrays taken along their batch axis)."""
        xp = st.xp
        arrays = self._layer_arrays(st)
        axes = self._batch_axes(st, arrays)
        take = xp.asarray(rows, dtype=xp.int64, device=st.device)
        picked = {n: a if axes[n] is None else xp.take(a, take, axis=axes[n]) for n, a in arrays.items()}
        new = self._restore_layer(xp, st.device, len(rows), st.dtype, st.length, picked)
        new.fixed_end, new.fixed_known = st.fixed_end, st.fixed_known  # as fork's copy of a layer keeps them
        return new

    def _batch_axes(self, st: _S, arrays: dict[str, Array]) -> dict[str, int | None]:
        """Per array of layer ``st``: its batch axis, or None for an array all rows share (hook).

        By default from the layer's layout asked for :data:`PROBE_BATCH` rows (see the module
        docstring); a cache without a layout must override it.
        """
        layout = self._layer_layout(st.xp, PROBE_BATCH, st.dtype, st.length)
        if layout is None:
            raise NotImplementedError(
                f"the {self.method!r} cache does not describe its layers' arrays (_layer_layout), so their "
                "batch axes are unknown; it cannot select batch rows"
            )
        axes: dict[str, int | None] = {}
        for name, a in arrays.items():
            spec = layout.arrays.get(name)
            if spec is None:
                raise NotImplementedError(f"the {self.method!r} cache's layout does not describe its array {name!r}")
            found = [ax for ax, size in enumerate(spec.shape) if isinstance(size, int) and size == PROBE_BATCH]
            if len(found) > 1 or (found and int(a.shape[found[0]]) != st.batch):
                raise NotImplementedError(
                    f"the {self.method!r} cache's array {name!r} of shape {tuple(a.shape)} has no single batch "
                    f"axis of {st.batch} rows"
                )
            axes[name] = found[0] if found else None
        return axes


def select_rows_of(caches: Sequence[LayerBatchRows], indices: Any) -> None:
    """:meth:`LayerBatchRows.select_rows` of several caches as one step (the parts of a hybrid cache).

    Every cache's layer locks are taken, cache after cache, each in index order; every layer
    of every cache is rebuilt; then all are put in place. A refusal or failure leaves every
    cache as it was.

    Parameters
    ----------
    caches : sequence of LayeredCache
        The caches, locked in this order.
    indices : sequence of int or 1-D integer array
        See :meth:`LayerBatchRows.select_rows`.
    """
    rows = check_rows(indices)
    with contextlib.ExitStack() as locks:
        for cache in caches:
            locks.enter_context(cache._all_layers_locked())
        built = [cache._selected_states(rows) for cache in caches]
        for cache in caches:  # inside a transaction: its rollback puts these layers back
            cache._note_every_layer()
        for cache, states in zip(caches, built):  # nothing below can fail
            cache._states = states
            cache._rewrites += 1
