"""Taking tokens back and copying a cache: ``truncate``, ``truncate_all``, ``fork``.

:class:`LayerRollback` is a base of :class:`~arraykv.caches.LayeredCache`. A truncated layer
is the layer a direct build would hold: the same calls replayed with the cut tokens left out
(a call cut in part becoming a shorter call). Tokens that a direct build holds exactly (in a
float16 window, a pending key group, an int value window) but that this layer has encoded
already are rebuilt from its *rollback copies*: float16 copies of the last ``rollback_tokens``
tokens it encoded (for the int caches: the exact keys of the last key groups it quantized,
enough to refill a partial group ``rollback_tokens`` deep, and the last values that left the
window), exactly what the direct build holds for them. Two things cannot be rebuilt, so a
truncation that needs them is refused before anything changes: tokens deeper than the copies
reach, and a calibration other than the layer's (the polar calibration, the ``lowrank``/``vq``
fit, the int caches' power-of-two units) that a direct build would compute from fewer tokens:
a cut inside the call that calibrated the layer, or below it where the direct build still
calibrates. Below that call a direct build may not have calibrated at all (a short prompt
whose window first spilled in a later decode): the window caches then rebuild that
uncalibrated state when the layer still holds every token of it exactly (sinks, window and
copies), so the reachable lengths are 0 and up to two intervals, ``1 .. U`` and ``F ..
seq_len`` (:meth:`LayerRollback.can_truncate`). The hooks of a cache are
``_truncate_floor(state)`` (the smallest ``L`` above 0 with every length from ``L`` to the
layer's length reachable), ``_reachable(state, length)`` and ``_reach_ranges(state)`` (by
default: the lengths from the floor on), and ``_truncate_plan(state, length)`` (everything
that can fail, computed; returns a function that commits without failing).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._types import Array, Device, DType, Namespace
from .._validation import check_int
from ..protocol import TruncatableKVCache, contract_doc
from .layer import LayerState

_T = TypeVar("_T")
#: The layer state of a cache class (:class:`LayerState` or a subclass).
_S = TypeVar("_S", bound=LayerState)
_Cache = TypeVar("_Cache", bound="LayerRollback")

__all__ = ["LayerRollback", "DEFAULT_ROLLBACK_TOKENS", "RECORD_NBYTES", "check_rollback_tokens", "keep_last"]

#: Bytes of the record of a layer's calibrating call (``fixed_end``, saved as one int64).
RECORD_NBYTES = 8
#: Tokens a layer can always be truncated by (after its calibrating call): the default of
#: the ``rollback_tokens`` option of the compressed caches.
DEFAULT_ROLLBACK_TOKENS = 16


def check_rollback_tokens(value: object) -> int:
    """``value`` as an int >= 0 (the ``rollback_tokens`` option), else ``TypeError``/``ValueError``."""
    return check_int("rollback_tokens", value, low=0)


def keep_last(xp: Namespace, held: Array, new: Array, cap: int) -> Array:
    """The last ``cap`` rows (axis 2) of ``held ++ new``: a rolling store of copies."""
    if cap <= 0:
        return held[:, :, :0, :]
    if int(new.shape[2]) >= cap:
        return xp.asarray(new[:, :, int(new.shape[2]) - cap :, :], copy=True)
    both = xp.concat([held, new], axis=2)
    n = int(both.shape[2])
    return both if n <= cap else both[:, :, n - cap :, :]


class LayerRollback(Generic[_S]):
    """``truncate``, ``truncate_all``, ``min_truncate_length``, ``fork`` for a cache with
    ``_locks``, ``_states`` and the hooks above."""

    #: Tokens of rollback copies a layer keeps (see the module docstring); 0 for caches that need none.
    rollback_tokens: int = 0

    if TYPE_CHECKING:  # what the cache class provides (:class:`~arraykv.caches.LayeredCache`)
        num_layers: int
        _locks: list[threading.Lock]
        _states: list[_S | None]
        _transactions: dict[int, list[Any]]
        _rewrites: int

        def _check_layer(self, layer: int) -> int: ...
        def _all_layers_locked(self) -> contextlib.AbstractContextManager[None]: ...
        def _on_reset(self) -> None: ...
        def _note(self, layer: int, *, truncating: bool = False) -> Any: ...
        def _note_every_layer(self) -> None: ...
        def _with_layer(self, layer: int, read: Callable[[_S], _T]) -> _T | None: ...
        def _layer_arrays(self, state: _S) -> dict[str, Array]: ...
        def _restore_layer(
            self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
        ) -> _S: ...

    def truncate(self, layer: int, length: int) -> None:
        """Drop the tokens of ``layer`` from index ``length`` on, exactly.

        Afterwards the layer is the layer a direct build would hold: ``seq_len``,
        ``dequantize``, ``stable_length``, what later calls return, and the saved arrays are
        those of the same calls replayed without the dropped tokens (see Notes for the
        rollback copies). ``length == seq_len`` changes nothing; ``length == 0`` empties the
        layer (always possible).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        length : int
            ``0``, ``min_truncate_length(layer) <= length <= seq_len(layer)``, or a shorter
            length :meth:`can_truncate` accepts.

        Raises
        ------
        TypeError
            ``layer`` or ``length`` not an int.
        ValueError
            Out of range, or not reachable exactly (deeper than the rollback copies reach, or
            where a direct build would calibrate on other tokens); the message names the
            lengths reachable and ``rollback_tokens``. Nothing changes.

        Notes
        -----
        Cost: O(rollback copies + window) array work, plus a copy of the kept tokens when a
        buffer's spare room would exceed its growth bound (:meth:`TokenBuffers.truncate`). The
        rollback copies themselves are the one part that is not the direct build's: the copies
        of the dropped encoded tokens are gone, so the layer holds fewer of them (and fewer
        bytes, :meth:`rollback_bytes`) until new tokens are encoded. ``length == 0`` takes
        every layer lock (in index order), and drops the cache's fixed state (rotations,
        codebooks) when no layer holds a token any more, as :meth:`reset` does.
        """
        layer = self._check_layer(layer)
        length = check_int("length", length, low=0)
        if length == 0:  # every lock: when the cache ends up empty, its fixed state goes too (like reset)
            with self._all_layers_locked():
                commit = self._plan_truncate(layer, 0)
                if commit is not None:
                    commit()
                    self._rewrites += 1
                    if all(st is None for st in self._states):
                        self._on_reset()
            return
        with self._locks[layer]:
            commit = self._plan_truncate(layer, length)
            if commit is not None:
                commit()
                self._rewrites += 1

    def truncate_all(self, length: int) -> None:
        """Truncate every layer holding more than ``length`` tokens to ``length`` (all or none).

        Takes every layer lock in index order, checks every layer, then truncates them all;
        layers holding ``length`` tokens or fewer are left as they are (a step that failed
        half way leaves some layers shorter). ``truncate_all(0)`` empties the cache like
        :meth:`reset`.

        Parameters
        ----------
        length : int
            Tokens every layer keeps at most, ``0 <= length <=`` the longest layer's ``seq_len``.

        Raises
        ------
        ValueError
            ``length`` above every layer's ``seq_len``, or a layer that cannot reach it
            exactly (see :meth:`truncate`); nothing changes.
        """
        length = check_int("length", length, low=0)
        with self._all_layers_locked():
            top = max((0 if st is None else st.length) for st in self._states)
            if length > top:
                raise ValueError(f"length must be in [0, {top}] (the longest layer's seq_len), received {length}")
            if length == 0:
                self._note_every_layer()
                self._states = [None] * self.num_layers
                self._on_reset()
                self._rewrites += 1
                return
            commits = [
                self._plan_truncate(i, min(length, 0 if st is None else st.length)) for i, st in enumerate(self._states)
            ]
            for commit in commits:
                if commit is not None:
                    commit()
                    self._rewrites += 1

    def min_truncate_length(self, layer: int) -> int:
        """The smallest length ``L`` above 0 such that :meth:`truncate` can reach every length
        from ``L`` to ``seq_len(layer)`` in ``layer`` now.

        0 is always reachable too. ``seq_len`` when no shorter length is reachable from the
        top (the copies reach no deeper, or the layer was calibrated by its latest call); 0
        for an empty layer. Some lengths below it may be reachable as well (a window cache
        calibrated by a call after a short prompt can go back to the uncalibrated layer of
        its first tokens): :meth:`can_truncate` answers for one length. A speculative decoding
        loop checks it before it appends a draft.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            ``L``, ``0 <= L <= seq_len(layer)``.
        """
        got = self._with_layer(layer, lambda st: min(st.length, max(1, self._truncate_floor(st))))
        return 0 if got is None else got

    @contract_doc(TruncatableKVCache.can_truncate)
    def can_truncate(self, layer: int, length: int) -> bool:
        layer = self._check_layer(layer)
        length = check_int("length", length, low=0)
        with self._locks[layer]:
            st = self._states[layer]
            n = 0 if st is None else st.length
            return length in (0, n) or (length < n and st is not None and self._reachable(st, length))

    def rollback_bytes(self) -> int:
        """Bytes held for :meth:`truncate` by every layer: the rollback copies, and 8 bytes per
        layer recording its calibrating call (counted in :meth:`memory_usage` too; 0 for ``dense``).

        Returns
        -------
        int
            The bytes, summed over the layers.
        """
        total = 0
        for i, lock in enumerate(self._locks):
            with lock:
                st = self._states[i]
                total += 0 if st is None else self._rollback_nbytes(st)
        return total

    def fork(self: _Cache) -> _Cache:
        """An independent cache with the same configuration and state.

        Writes to either never affect the other. Cost: a full copy of every layer's arrays
        (O(bytes held), under all layer locks, in index order), into exact-size buffers, so
        the fork's :meth:`memory_usage` may be lower than this cache's; the fixed state that
        never changes (rotations, codebooks, given calibrations) is shared read-only.

        Returns
        -------
        LayeredCache
            A cache of the same class, configuration and stored tokens.
        """
        twin = copy.copy(self)
        twin._locks = [threading.Lock() for _ in range(self.num_layers)]
        twin._transactions = {}  # the fork is outside this cache's transactions
        twin._fork_fixed(self)
        with self._all_layers_locked():
            twin._states = [None if st is None else self._copy_layer(st) for st in self._states]
        return twin

    # -- internals ----------------------------------------------------------------------
    def _plan_truncate(self, layer: int, length: int) -> Callable[[], None] | None:
        """Check a truncation of ``layer`` (lock held); None when nothing changes, else a commit."""
        st = self._states[layer]
        n = 0 if st is None else st.length
        if length > n:
            raise ValueError(f"length must be in [0, {n}] (seq_len of layer {layer}), received {length}")
        if length == n:
            return None
        if length == 0:

            def empty() -> None:
                self._note(layer)
                self._states[layer] = None

            return empty
        assert st is not None  # 0 < length < n
        if not self._reachable(st, length):
            raise ValueError(self._refusal(layer, st, length))
        commit = self._truncate_plan(st, length)

        def apply() -> None:
            self._note(layer, truncating=True)  # before the rows it shares with its records are cut
            commit()
            st.length = length

        return apply

    def _refusal(self, layer: int, st: _S, length: int) -> str:
        ranges = self._reach_ranges(st)
        items = ["0"] + [f"{a}" if a == b else f"{a} .. {b}" for a, b in ranges]
        reach = "only 0" if ranges == [(st.length, st.length)] else ", ".join(items[:-1]) + " or " + items[-1]
        copies = f"rollback_tokens={self.rollback_tokens}; a larger value reaches deeper"
        if length >= st.fixed_end:
            why = f"deeper than its rollback copies reach ({copies})"
        else:
            why = f"below {st.fixed_end}, the end of the call that calibrated it, and "
            if not st.fixed_known and getattr(self, "_calibration_given", True):
                why += "the file it was loaded from does not record that call (it may have been given)"
            elif getattr(self, "_uncalibrated_at", lambda s, n: False)(st, length):
                why += (
                    f"the uncalibrated layer a direct build holds there needs tokens deeper than its rollback "
                    f"copies reach ({copies})"
                )
            else:
                why += "a direct build would calibrate on other tokens"
        return f"cannot truncate layer {layer} to {length} exactly: it can reach {reach}; {length} is {why}"

    def _copy_layer(self, st: _S) -> _S:
        arrays = {n: st.xp.asarray(a, copy=True) for n, a in self._layer_arrays(st).items()}
        twin = self._restore_layer(st.xp, st.device, st.batch, st.dtype, st.length, arrays)
        twin.fixed_end, twin.fixed_known = st.fixed_end, st.fixed_known  # also where no file records it
        return twin

    def _fork_fixed(self, source: Any) -> None:
        """Give a fork its own copies of the cache-wide mutable state (hook; nothing by default)."""

    def _truncate_floor(self, state: _S) -> int:
        """Smallest ``L`` above 0 with every length ``L .. state.length`` reachable (hook); by
        default none but the current one."""
        return state.length

    def _reachable(self, state: _S, length: int) -> bool:
        """Whether ``0 < length < state.length`` is reachable exactly (hook); by default the
        lengths from the floor on."""
        return length >= max(1, self._truncate_floor(state))

    def _reach_ranges(self, state: _S) -> list[tuple[int, int]]:
        """The reachable lengths above 0 as ``[(first, last), ...]``, ascending (hook)."""
        return [(min(state.length, max(1, self._truncate_floor(state))), state.length)]

    def _truncate_plan(self, state: _S, length: int) -> Callable[[], None]:
        raise NotImplementedError

    def _rollback_nbytes(self, state: _S) -> int:
        return 0
