"""Growable per-layer token buffers with amortized growth."""

from __future__ import annotations

import math
from collections.abc import Mapping

from .. import _compat
from .._types import Array

__all__ = ["TokenBuffers"]

#: What :meth:`TokenBuffers.truncate_plan` returns: ``(length, fresh arrays or None, capacity)``.
TruncatePlan = tuple[int, dict[str, Array] | None, int]
#: What :meth:`TokenBuffers.mark` returns: ``(arrays, length, capacity, reallocations)``.
BufferMark = tuple[dict[str, Array], int, int, int]


class TokenBuffers:
    """Named arrays that share a token axis (axis 2), sized exactly for prompts and grown in bounded steps.

    Each array has shape ``(batch, heads, capacity, *rest)``; ``length`` tokens of it are in
    use. The first append of several tokens (a prompt) allocates exactly those tokens. An
    append that does not fit later reallocates to ``max(needed, held + step)`` tokens with
    ``step = min(max(min_capacity, (growth − 1) × needed), max_step)``: geometric steps while
    the buffers are small, then fixed steps of ``max_step`` tokens. So the spare room never
    exceeds ``min(max_step, (growth − 1) × used + min_capacity)`` tokens (64 tokens by
    default: under 1 % of what an 8k-token layer uses).

    Parameters
    ----------
    growth : float, default 1.1
        Bound on capacity over use while the steps are geometric (> 1).
    min_capacity : int, default 64
        Smallest growth step, in tokens.
    max_step : int, default 64
        Largest growth step, in tokens (taken as ``min_capacity`` when smaller).
    max_tokens : int or None
        Hard limit on tokens; appends beyond it raise ``ValueError`` and write nothing.
        When given, the first allocation reserves ``max_tokens`` directly (no regrowth).

    Attributes
    ----------
    length : int
        Tokens in use.
    capacity : int
        Tokens allocated.
    reallocations : int
        How many times the buffers were reallocated (for tests of the growth policy).

    Notes
    -----
    Cost: a reallocation copies the tokens in use. While the steps are geometric (up to
    ``max_step / (growth − 1)`` tokens, 640 by default) ``n`` appended tokens cost O(n)
    copies; past that a layer of ``n`` tokens is copied once every ``max_step`` appended
    tokens, O(n / max_step) per token appended, O(n² / (2 · max_step)) over a decode of ``n``
    tokens. A decode step that attends reads all ``n`` tokens, so the copies add at most
    ``1 / max_step`` of what attention reads anyway (1.6 % at 64). The buffers stay one
    contiguous array each, which the fused kernels read (a list of fixed blocks would avoid
    the copies but not be one array). Truncation keeps spare room up to ``min(growth ×
    length + min_capacity, length + 2 × max_step)`` tokens (a draft of up to ``max_step``
    tokens taken back does not copy).
    """

    def __init__(
        self, *, growth: float = 1.1, min_capacity: int = 64, max_step: int = 64, max_tokens: int | None = None
    ):
        if not float(growth) > 1.0:
            raise ValueError(f"growth must be > 1, received {growth!r}")
        self.growth = float(growth)
        self.min_capacity = int(min_capacity)
        self.max_step = max(int(max_step), self.min_capacity)
        self.max_tokens = max_tokens
        self.length = 0
        self.capacity = 0
        self.reallocations = 0
        self._arrays: dict[str, Array] = {}

    # -- queries -----------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return tuple(self._arrays)

    def view(self, name: str) -> Array:
        """The in-use part ``[:, :, :length]`` of array ``name`` (a view; do not write into it)."""
        return self._arrays[name][:, :, : self.length, ...]

    def used_nbytes(self) -> int:
        """Bytes of the in-use parts of all arrays."""
        total = 0
        for a in self._arrays.values():
            per_token = _compat.array_nbytes(a) // max(int(a.shape[2]), 1)
            total += per_token * self.length
        return total

    def reserved_nbytes(self) -> int:
        """Bytes allocated, including spare capacity."""
        return sum(_compat.array_nbytes(a) for a in self._arrays.values())

    def check_room(self, tokens: int) -> None:
        """Raise ``ValueError`` if ``tokens`` more would exceed ``max_tokens``."""
        if self.max_tokens is not None and self.length + tokens > self.max_tokens:
            raise ValueError(
                f"the cache holds at most max_tokens={self.max_tokens} tokens per layer; "
                f"it holds {self.length} and {tokens} more were given"
            )

    # -- mutation ----------------------------------------------------------------
    def append(self, arrays: Mapping[str, Array]) -> None:
        """Append arrays of shape ``(batch, heads, t, *rest)``; all share ``t``.

        The first call fixes the names, dtypes and trailing shapes. Nothing is written if a
        check or an allocation fails.
        """
        if not arrays:
            return
        counts = {int(a.shape[2]) for a in arrays.values()}
        if len(counts) != 1:
            raise ValueError(f"arrays to append must share one token count, received {sorted(counts)}")
        t = counts.pop()
        if self._arrays and set(arrays) != set(self._arrays):
            raise ValueError(f"expected arrays {sorted(self._arrays)}, received {sorted(arrays)}")
        self.check_room(t)
        need = self.length + t
        if need > self.capacity:
            self._grow(arrays, need, t)
        n = self.length
        for name, a in arrays.items():
            self._arrays[name][:, :, n : n + t, ...] = a
        self.length = need

    def reserve(self, arrays: Mapping[str, Array]) -> None:
        """Make room for appending ``arrays`` (as :meth:`append` takes them) without writing them.

        After it returns, ``append(arrays)`` allocates nothing and cannot fail for lack of
        memory: a cache that appends to several buffers reserves all of them first, so a failed
        allocation leaves every buffer as it was. Raises like :meth:`append`.
        """
        if not arrays:
            return
        t = max(int(a.shape[2]) for a in arrays.values())
        self.check_room(t)
        if self.length + t > self.capacity:
            self._grow(arrays, self.length + t, t)

    def room(self, tokens: int) -> dict[str, Array]:
        """The arrays, whole (capacity included), with room for ``tokens`` more after ``length``.

        For a writer that fills rows ``length .. length + tokens`` in place and then calls
        :meth:`advance`: it writes nothing while ``length`` stays, so a step that fails between
        the two leaves the buffers' content as it was. Grows (allocating) like :meth:`append`;
        needs arrays to exist (a first :meth:`append`). Raises like :meth:`check_room`.
        """
        if not self._arrays:
            raise ValueError("room() needs buffers created by a first append()")
        self.check_room(tokens)
        if self.length + tokens > self.capacity:
            self._grow(self._arrays, self.length + tokens, tokens)
        return dict(self._arrays)

    def advance(self, tokens: int) -> None:
        """Take ``tokens`` more rows into use, written in place after a :meth:`room` call."""
        if self.length + tokens > self.capacity:
            raise ValueError(f"advance by {tokens} past the capacity of {self.capacity} tokens")
        self.length += tokens

    def _grow(self, template: Mapping[str, Array], need: int, tokens: int) -> None:
        if self.max_tokens is not None:
            new_cap = self.max_tokens
        elif self.capacity == 0 and tokens > 1:
            new_cap = need  # a first prompt: exactly its tokens
        else:
            new_cap = max(need, self.length + self._step(need))
        fresh = {}
        for name, a in template.items():
            xp = _compat.namespace(a)
            shape = tuple(int(s) for s in a.shape)
            shape = shape[:2] + (new_cap,) + shape[3:]
            buf = xp.empty(shape, dtype=a.dtype, device=_compat.device(a))
            if self.length:
                buf[:, :, : self.length, ...] = self._arrays[name][:, :, : self.length, ...]
            fresh[name] = buf
        # Swap only after every allocation succeeded.
        self._arrays = fresh
        self.capacity = new_cap
        self.reallocations += 1

    def _step(self, need: int) -> int:
        """Tokens of room beyond the current length a growth to ``need`` tokens makes."""
        return min(max(self.min_capacity, int(math.ceil((self.growth - 1.0) * need))), self.max_step)

    def spare_bound(self, length: int) -> int:
        """Most spare tokens a truncation to ``length`` keeps (see Notes)."""
        return int(min(self.growth * length + self.min_capacity, length + 2 * self.max_step)) - length

    def truncate_plan(self, length: int) -> TruncatePlan:
        """What :meth:`truncate` to ``length`` will do, with every allocation already made.

        Returns an opaque plan for :meth:`commit_truncate` (which cannot fail). A cache that
        truncates several buffers plans all of them first, so a failed allocation changes none.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}], received {length}")
        if length == 0:
            return (0, {}, 0)
        if self.max_tokens is not None or self.capacity <= length + self.spare_bound(length):
            return (length, None, self.capacity)  # spare room within the growth bound: kept for the next appends
        fresh = {n: _compat.namespace(a).asarray(a[:, :, :length, ...], copy=True) for n, a in self._arrays.items()}
        return (length, fresh, length)

    def commit_truncate(self, plan: TruncatePlan) -> None:
        """Apply a plan of :meth:`truncate_plan` (nothing allocates; cannot fail)."""
        length, fresh, capacity = plan
        if fresh is not None:
            self._arrays = fresh
        self.length = length
        self.capacity = capacity

    def truncate(self, length: int) -> None:
        """Forget tokens past ``length`` (``0 <= length <= self.length``).

        The capacity obeys the growth bound afterwards: spare room up to :meth:`spare_bound`
        tokens is kept (the next appends need no reallocation), more is released
        by copying the kept tokens into an exact-size allocation; at 0 every array is dropped.
        With ``max_tokens`` the buffers keep their one allocation.
        """
        self.commit_truncate(self.truncate_plan(length))

    def mark(self) -> BufferMark:
        """What the buffers hold now, for :meth:`rewind` (no copy: the arrays are referenced).

        Appends write only rows past ``length`` and growth copies into new arrays, so the rows
        a mark covers stay as they were until a :meth:`truncate` below its length is followed
        by an append; :meth:`detach_mark` makes a mark independent of that (a copy).
        """
        return (dict(self._arrays), self.length, self.capacity, self.reallocations)

    def rewind(self, mark: BufferMark) -> None:
        """Put back what :meth:`mark` recorded: the same arrays, length and capacity (cannot fail)."""
        arrays, self.length, self.capacity, self.reallocations = mark
        self._arrays = dict(arrays)

    @staticmethod
    def detach_mark(mark: BufferMark) -> BufferMark:
        """``mark`` with its rows copied into exact-size arrays, independent of later writes."""
        arrays, length, _, reallocations = mark
        held = {n: _compat.namespace(a).asarray(a[:, :, :length, ...], copy=True) for n, a in arrays.items()}
        return (held, length, length if held else 0, reallocations)

    def copy(self) -> TokenBuffers:
        """An independent copy: the in-use tokens in exact-size arrays, same options."""
        out = TokenBuffers(
            growth=self.growth, min_capacity=self.min_capacity, max_step=self.max_step, max_tokens=self.max_tokens
        )
        if self.length:
            out.append({n: _compat.namespace(a).asarray(a, copy=True) for n, a in self.arrays().items()})
        return out

    def clear(self) -> None:
        """Drop every array and its memory."""
        self._arrays = {}
        self.length = 0
        self.capacity = 0

    def arrays(self) -> dict[str, Array]:
        """The in-use views of all arrays, by name."""
        return {name: self.view(name) for name in self._arrays}
