"""Taking a cache's state out and putting it back: snapshots, restore, and saving to a file.

:class:`LayerSnapshots` is a base of :class:`~arraykv.caches.LayeredCache`; it works through
the cache's per-layer locks and its hooks ``_layer_arrays`` (the arrays of a layer by their
saved names) and ``_restore_layer`` (a layer rebuilt from them, checked).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._validation import dtype_name
from ..storage.cache_file import LAYER_DTYPES, LayerRecord, write_cache_file
from .layer import LayerState

__all__ = ["LayerSnapshots"]


class LayerSnapshots:
    """Snapshot, restore and save for a cache with ``_locks``, ``_states`` and the two hooks."""

    def save(self, path) -> int:
        """Write the cache to ``path``; return the file size in bytes.

        The format is :mod:`arraykv.storage.cache_file`; :func:`arraykv.load` reads it back.
        Every layer's lock is held while the state is copied to the host, so the file is one
        consistent snapshot even while other threads decode.
        """
        return write_cache_file(path, self.get_config(), self.snapshot(host=True))

    def snapshot(self, *, host: bool = False) -> list:
        """Copies of every layer's state: per layer None (empty) or a
        :class:`~arraykv.storage.cache_file.LayerRecord` whose arrays are copies in the cache's
        namespace (``host=True``: NumPy copies on the host, what :meth:`save` writes). Taken under
        every layer's lock: one consistent state. :meth:`restore` takes it back.
        """
        with self._all_layers_locked():
            return [None if st is None else self._record(st, host=host) for st in self._states]

    def restore(self, layers: list, *, xp: Any = None) -> None:
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
            When the entries do not describe a state of this cache (wrong count, missing or
            misshapen arrays, lengths that disagree). Every layer is rebuilt and checked before
            any is replaced: on an error the cache is unchanged.
        """
        if not isinstance(layers, (list, tuple)) or len(layers) != self.num_layers:
            raise ValueError(f"layers must be a list of num_layers={self.num_layers} entries")
        states = []
        for i, rec in enumerate(layers):
            if rec is None:
                states.append(None)
                continue
            arrays = dict(rec.arrays)
            ns = xp if xp is not None else (_compat.namespace(*arrays.values()) if arrays else None)
            if ns is None:
                raise ValueError(f"layer {i} holds no arrays; pass xp")
            arrays = {n: ns.asarray(a) for n, a in arrays.items()}
            if not hasattr(ns, rec.dtype) or rec.dtype not in LAYER_DTYPES:
                raise ValueError(f"layer {i} has dtype {rec.dtype!r}, which this namespace does not offer")
            first = next(iter(arrays.values()), None)
            dev = _compat.device(first) if first is not None else None
            try:
                st = self._restore_layer(ns, dev, int(rec.batch), getattr(ns, rec.dtype), int(rec.length), arrays)
            except (KeyError, IndexError, TypeError) as exc:
                raise ValueError(f"layer {i} does not describe a {self.method!r} layer: {exc!r}") from None
            states.append(st)
        with self._all_layers_locked():
            self._states = states

    def _record(self, st: LayerState, *, host: bool) -> LayerRecord:
        arrays = self._layer_arrays(st)
        if host:  # copies taken under the lock: the file is this state whatever happens after
            arrays = {n: _compat.to_numpy(a, copy=True) for n, a in arrays.items()}
        else:
            arrays = {n: st.xp.asarray(a, copy=True) for n, a in arrays.items()}
        return LayerRecord(length=st.length, batch=st.batch, dtype=dtype_name(st.dtype), arrays=arrays)
