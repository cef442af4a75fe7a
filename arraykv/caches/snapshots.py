"""Taking a cache's state out and putting it back: snapshots, restore, and saving to a file.

:class:`LayerSnapshots` is a base of :class:`~arraykv.caches.LayeredCache`; it works through
the cache's per-layer locks and its hooks ``_layer_arrays`` (the arrays of a layer by their
saved names), ``_layer_layout`` (what those arrays must be) and ``_restore_layer`` (a layer
rebuilt from them).

What :meth:`LayerSnapshots.restore` is given comes from a file or a caller and is not
trusted: each record's header is checked (``length`` and ``batch`` integers of at least 1,
``dtype`` one of :data:`~arraykv.storage.cache_file.LAYER_DTYPES` that the namespace offers,
``arrays`` a dict of arrays by name), then its arrays against the cache's layout of a layer
of that header (:func:`~arraykv.caches.layout.check_layout`: every dtype, shape, size, index
and value range), and only then is a layer built; the cache's ``_restore_layer`` then refuses
a layer that leaves no float16 room for its window or the next token of ordinary magnitude
(:mod:`arraykv.caches.restore_checks`: a mean, window token, basis or exact key that would make
every later call fail). A layer of float16 (or bfloat16) callers is then decoded once: parts
each inside their range (a length, a mean, a channel weight) can still decode to keys or values
beyond that dtype, which no bound on the parts excludes without refusing real files (float32
layers are covered by the parts' bounds). Every layer is built
before any replaces the cache's, so a refused restore leaves the cache as it was.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .. import _compat
from .._types import Array, Device, DType, Namespace
from .._validation import dtype_name
from ..storage.cache_file import LAYER_DTYPES, LayerRecord, write_cache_file
from .layer import LayerState
from .layout import Layout, check_layout

if TYPE_CHECKING:
    from ..protocol import DequantResult

__all__ = ["LayerSnapshots"]

#: The layer state of a cache class (:class:`LayerState` or a subclass).
_S = TypeVar("_S", bound=LayerState)


class LayerSnapshots(Generic[_S]):
    """Snapshot, restore and save for a cache with ``_locks``, ``_states`` and the two hooks."""

    if TYPE_CHECKING:  # what the cache class provides (:class:`~arraykv.caches.LayeredCache`)
        method: str
        num_layers: int
        max_tokens: int | None
        _locks: list[threading.Lock]
        _states: list[_S | None]
        _rewrites: int

        def get_config(self) -> dict[str, Any]: ...
        def _all_layers_locked(self) -> contextlib.AbstractContextManager[None]: ...
        def _note_every_layer(self) -> None: ...
        def _decoded(self, state: _S, start: int = 0) -> DequantResult: ...
        def _layer_arrays(self, state: _S) -> dict[str, Array]: ...
        def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout | None: ...
        def _restore_layer(
            self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
        ) -> _S: ...

    def save(self, path: str | os.PathLike[str]) -> int:
        """Write the cache to ``path``; return the file size in bytes.

        The format is :mod:`arraykv.storage.cache_file`; :func:`arraykv.load` reads it back.
        Every layer's lock is held while the state is copied to the host, so the file is one
        consistent snapshot even while other threads decode.

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

    def snapshot(self, *, host: bool = False) -> list[LayerRecord | None]:
        """Copies of every layer's state: per layer None (empty) or a
        :class:`~arraykv.storage.cache_file.LayerRecord` whose arrays are copies in the cache's
        namespace (``host=True``: NumPy copies on the host, what :meth:`save` writes). Taken under
        every layer's lock: one consistent state. :meth:`restore` takes it back.

        Parameters
        ----------
        host : bool, default False
            Copy the arrays to NumPy arrays on the host instead of the cache's namespace.

        Returns
        -------
        list of LayerRecord or None
            ``num_layers`` entries, in layer order.
        """
        with self._all_layers_locked():
            return [None if st is None else self._record(st, host=host) for st in self._states]

    def restore(self, layers: list[LayerRecord | None], *, xp: Namespace | None = None) -> None:
        """Replace the state of every layer by ``layers`` (from :meth:`snapshot` or a cache file).

        Parameters
        ----------
        layers : list
            ``num_layers`` entries, each None or a ``LayerRecord`` (``length``, ``batch``,
            ``dtype`` name, ``arrays`` by name as :meth:`layer_arrays` names them).
        xp : namespace, optional
            Namespace of the restored arrays; default: that of the arrays given.

        Raises
        ------
        ValueError
            When the entries do not describe a state of this cache (wrong count, a malformed
            header, missing, unknown or misshapen arrays, lengths that disagree, indices out
            of range, non-finite values; see the module docstring). Every layer is checked and
            rebuilt before any is replaced: on an error the cache is unchanged.
        """
        if not isinstance(layers, (list, tuple)) or len(layers) != self.num_layers:
            raise ValueError(f"layers must be a list of num_layers={self.num_layers} entries")
        states: list[_S | None] = []
        for i, rec in enumerate(layers):
            if rec is None:
                states.append(None)
                continue
            try:
                states.append(self._restore_record(rec, xp))
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise ValueError(f"layer {i} does not describe a {self.method!r} layer: {exc}") from None
        with self._all_layers_locked():
            self._note_every_layer()  # inside a transaction: recorded, so a rollback brings them back
            self._states = states
            self._rewrites += 1

    def _restore_record(self, rec: LayerRecord, xp: Namespace | None) -> _S:
        """A layer built from record ``rec`` once its header and arrays passed every check."""
        arrays: Any
        length: Any
        batch: Any
        name: Any
        arrays, length, batch, name = (getattr(rec, f, None) for f in ("arrays", "length", "batch", "dtype"))
        if not isinstance(arrays, dict) or not all(isinstance(n, str) for n in arrays):
            raise ValueError("a record's arrays must be a dict of arrays by name")
        for field, value in (("length", length), ("batch", batch)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"a record's {field} must be an integer >= 1, received {value!r}")
        length, batch = int(length), int(batch)
        if self.max_tokens is not None and length > self.max_tokens:
            raise ValueError(f"a record's length {length} is more than max_tokens={self.max_tokens}")
        ns = xp if xp is not None else (_compat.namespace(*arrays.values()) if arrays else None)
        if ns is None:
            raise ValueError("the record holds no arrays; pass xp")
        if not isinstance(name, str) or name not in LAYER_DTYPES or not hasattr(ns, name):
            raise ValueError(f"dtype {name!r} is not one of {LAYER_DTYPES} that this namespace offers")
        dtype = getattr(ns, name)
        arrays = {n: ns.asarray(a) for n, a in arrays.items()}
        layout = self._layer_layout(ns, batch, dtype, length)
        if layout is not None:
            check_layout(ns, arrays, layout)
        first = next(iter(arrays.values()), None)
        dev = _compat.device(first) if first is not None else None
        st = self._restore_layer(ns, dev, batch, dtype, length, arrays)
        if name in ("float16", "bfloat16"):  # parts in range can still decode past a half-precision dtype
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the overflow is the finding, said below
                r = self._decoded(st)
            for side, decoded in (("k", r.k), ("v", r.v)):
                if not _compat.all_finite(ns, [decoded]):
                    held = sorted(n for n in arrays if n.startswith(side + "_"))
                    raise ValueError(
                        f"the stored {'keys' if side == 'k' else 'values'} (arrays {held}) decode beyond the "
                        f"range of {name}"
                    )
        return st

    def _record(self, st: _S, *, host: bool) -> LayerRecord:
        arrays = self._layer_arrays(st)
        if host:  # copies taken under the lock: the file is this state whatever happens after
            arrays = {n: _compat.to_numpy(a, copy=True) for n, a in arrays.items()}
        else:
            arrays = {n: st.xp.asarray(a, copy=True) for n, a in arrays.items()}
        return LayerRecord(length=st.length, batch=st.batch, dtype=dtype_name(st.dtype), arrays=arrays)
