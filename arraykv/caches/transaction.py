"""All-or-nothing calls over several layers: cache transactions and the undo records they keep.

Layers run in sequence, so a step of a model (a prefill chunk, a decode step, a segment of a
stored prefix) that fails at layer ``i`` has already stored its tokens in layers ``0 ..
i-1``. A :class:`CacheTransaction` (``with cache.transaction():``, see
:meth:`arraykv.caches.LayeredCache.transaction`) keeps, for every layer, an undo record made
just before the transaction first changes it, and puts every such layer back when the
transaction rolls back: a failure anywhere inside (any exception, ``KeyboardInterrupt``,
``MemoryError``) leaves the cache exactly as it was, whatever the number of tokens.

A record is one of:

``EmptyUndo``
    The layer held nothing: rolling back empties it again.
``CopyUndo``
    A copy of the layer (the cache's ``_copy_layer``: its arrays copied into a new state).
    Costs O(bytes of the layer); the default, safe for any layer state.
``FieldUndo``
    The layer's fields as they were, for a state whose class says that its arrays are never
    written in place except where this module knows how (``LayerState.undo == "fields"``):
    token buffers are only appended to (:meth:`~arraykv.storage.TokenBuffers.mark` records
    their length and arrays, no copy); float16 blocks that slide in place (a
    :class:`~arraykv.caches.sliding.SlidingRows`: a window, the rollback copies, tens of rows)
    have their rows copied and written back into the same buffers at the same offset
    (:meth:`~arraykv.caches.sliding.SlidingRows.mark`), and so do a state's own rows written
    in place (``LayerState.mark_rows``: a window cache's held window); every other field is
    replaced by a store, never written into, so a reference keeps it. Costs O(window) per
    layer, independent of the tokens held. A restored layer is the same memory as before,
    not only the same values: the fused kernels, whose loop versions depend on where their
    buffers sit, then compute what they computed before, bit for bit.

A truncation inside a transaction first makes the layer's ``FieldUndo`` records independent
of the buffers (their rows copied): an append after a truncation writes rows that a record
may still need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..storage import TokenBuffers
from .layer import LayerState
from .sliding import SlidingRows
from .window import ExactTokens

__all__ = ["CacheTransaction", "LayerUndo", "EmptyUndo", "CopyUndo", "FieldUndo"]


class LayerUndo(Protocol):
    """What one layer was at one moment (see the module docstring)."""

    def restore(self) -> Any:
        """The layer state to put back (None for an empty layer); may be called more than once."""
        ...

    def detach(self) -> None:
        """Stop sharing arrays with the live layer (before a truncation rewrites rows)."""
        ...


class EmptyUndo:
    """A layer that held nothing."""

    __slots__ = ()

    def restore(self) -> None:
        return None

    def detach(self) -> None:
        pass


class CopyUndo:
    """A copy of the layer, made with ``copy_layer``; each :meth:`restore` gives a new copy of it."""

    __slots__ = ("_copy_layer", "_saved", "_given")

    def __init__(self, copy_layer: Callable[[LayerState], LayerState], state: LayerState):
        self._copy_layer = copy_layer
        self._saved = copy_layer(state)
        self._given = False

    def restore(self) -> LayerState:
        if not self._given:  # the first time the copy itself; later a copy of it (the first may have changed)
            self._given = True
            keep = self._saved
            self._saved = self._copy_layer(keep)
            return keep
        return self._copy_layer(self._saved)

    def detach(self) -> None:
        pass


class FieldUndo:
    """The fields of a layer state whose arrays are appended to or replaced, not rewritten."""

    __slots__ = ("_state", "_values", "_marks", "_rows", "_blocks", "_own")

    def __init__(self, state: LayerState):
        self._state = state
        values = dict(vars(state))  # the dataclass fields, by reference
        marks: dict[str, tuple] = {}
        rows: dict[str, tuple] = {}
        blocks: dict[str, Any] = {}
        sliding: list[tuple[str, SlidingRows]] = []
        exact: list[tuple[str, ExactTokens]] = []
        kinds = _KINDS
        for name, value in values.items():
            kind = kinds.get(type(value), _UNSEEN)
            if kind is None:
                continue
            if kind is _UNSEEN:
                kind = _kind(value)
                if kind is None:
                    continue
            if kind == "buffers":
                marks[name] = value.mark()
            elif kind == "rows":
                sliding.append((name, value))
                rows[name] = value.mark()
            elif kind == "block":
                exact.append((name, value))
            else:  # arrays by name, replaced whole by a store
                values[name] = dict(value)
        for name, block in exact:
            holder = None
            for n, r in sliding:
                if r.holds(block.k):
                    holder = n
                    break
            # a view of sliding rows is put back in place (the same memory); another block is
            # replaced by each store, never written into: kept as it is
            blocks[name] = (holder, block.n_sink) if holder is not None else block
        self._values, self._marks, self._rows, self._blocks = values, marks, rows, blocks
        self._own = state.mark_rows()

    def restore(self) -> LayerState:
        st = self._state
        for name, value in self._values.items():
            setattr(st, name, dict(value) if isinstance(value, dict) else value)
        for name, mark in self._marks.items():
            getattr(st, name).rewind(mark)
        for name, mark in self._rows.items():
            getattr(st, name).rewind(mark)
        for name, block in self._blocks.items():
            if isinstance(block, tuple):
                holder, n_sink = block
                rows = getattr(st, holder)
                setattr(st, name, ExactTokens(k=rows.k, v=rows.v, n_sink=n_sink))
        st.rewind_rows(self._own)
        return st

    def detach(self) -> None:
        self._marks = {name: TokenBuffers.detach_mark(m) for name, m in self._marks.items()}


#: The field types a :class:`FieldUndo` treats apart, by exact type (subclasses: :func:`_kind`).
_KINDS: dict[type, str | None] = {TokenBuffers: "buffers", SlidingRows: "rows", ExactTokens: "block", dict: "dict"}


#: What :data:`_KINDS` gives for a type not met yet.
_UNSEEN = "unseen"


def _kind(value: Any) -> str | None:
    """The kind of a value of a type not met yet (remembered for its type)."""
    kind = next((k for cls, k in _KINDS.items() if k and isinstance(value, cls)), None)
    _KINDS[type(value)] = kind
    return kind


def checkpoint(state: LayerState | None, copy_layer: Callable[[Any], Any]) -> LayerUndo:
    """The undo record of a layer now: empty, its fields, or a copy (see the module docstring)."""
    if state is None:
        return EmptyUndo()
    if getattr(state, "undo", "copy") == "fields":
        return FieldUndo(state)
    return CopyUndo(copy_layer, state)


class CacheTransaction:
    """Calls on one cache that take effect together or not at all.

    Made by :meth:`arraykv.caches.LayeredCache.begin_transaction` (or entered with
    ``with cache.transaction():``). Until :meth:`commit` or :meth:`rollback`, every layer a
    call changes gets an undo record first (once per transaction). Transactions nest: an inner
    one rolls back to its own start, an outer one to its start. The calls of the thread that
    began it belong to it; other threads' calls (on other layers) do not.

    Attributes
    ----------
    records : dict of int to LayerUndo
        The undo record of each layer changed so far.
    """

    def __init__(self, cache: Any, fixed: Any):
        self._cache = cache
        #: The thread that began it: its calls are the transaction's (``threading.get_ident()``).
        self.owner = threading.get_ident()
        self.records: dict[int, LayerUndo] = {}
        self.fixed = fixed
        #: True until :meth:`commit` or :meth:`rollback` ends the transaction.
        self.open = True

    @property
    def layers(self) -> list[int]:
        """The layers changed so far, ascending."""
        return sorted(self.records)

    def commit(self) -> None:
        """Keep what the calls did and drop the undo records (nothing to do once ended)."""
        self._cache._end_transaction(self, commit=True)

    def rollback(self) -> None:
        """Put every layer changed since the transaction began back as it was (nothing to do once
        ended); transactions begun inside it and still open roll back first."""
        self._cache._end_transaction(self, commit=False)

    def __repr__(self) -> str:
        state = "open" if self.open else "ended"
        return f"CacheTransaction({state}, layers={self.layers})"
