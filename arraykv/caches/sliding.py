"""Blocks of exact rows that slide by a token per decode step, updated in place.

A window cache's float16 block (sinks, then the recent window) and its rollback copies change
by one row per decode step once the window is full: the oldest recent row leaves, the new
token's row arrives. Building each new block by concatenation allocates and copies the whole
block every step and touches a new pair of arrays. :class:`SlidingRows` keeps the block as a
view of a buffer with a few spare rows after it: a step writes the arriving rows after the
block, moves the ``head`` rows (the sinks) forward over the rows that leave, and returns the
view one row further on; when the spare rows run out the block is moved back to the start of
the buffer (once every ``spare`` steps).

The views it returns are the block a concatenation would give, row for row; what was written
before is never changed while it is in use: the rows a step overwrites are the leaving rows
(already copied out, or dropped) and rows after the old block. A caller that replaced the
block by another array (a truncation, a store by concatenation) is detected by identity
(:meth:`SlidingRows.holds`) and the buffer is then rebuilt from that array.
"""

from __future__ import annotations

from .._compat import array_nbytes, device, namespace, plain_numpy
from .._types import Array, Namespace

__all__ = ["SlidingRows", "SPARE_ROWS", "copied"]

#: Spare rows after a sliding block (bytes: ``2 · batch · heads · head_dim · 2`` per row for
#: float16 keys and values); the block moves back to the buffer's start once every that many steps
#: (a copy of the block's rows, a window's few dozen: a few rows per step for a spare room of
#: 4 rows, which a layer of 511 tokens holds at an eighth of a bit per value).
SPARE_ROWS = 4


class SlidingRows:
    """Key and value rows ``(batch, heads, n, head_dim)`` held at an offset of larger buffers.

    Parameters
    ----------
    xp : namespace
    k, v : array (batch, heads, n, head_dim)
        The block to hold (copied into the new buffers).
    spare : int
        Rows of room after the block.

    Attributes
    ----------
    k, v : array
        The current block: views of the buffers (read them, never write).
    """

    __slots__ = ("_kb", "_vb", "_off", "k", "v")

    def __init__(self, xp: Namespace, k: Array, v: Array, spare: int = SPARE_ROWS):
        n = int(k.shape[2])
        shape = tuple(int(s) for s in k.shape)
        shape = shape[:2] + (n + max(1, spare),) + shape[3:]
        self._kb = xp.empty(shape, dtype=k.dtype, device=device(k))
        self._vb = xp.empty(shape, dtype=v.dtype, device=device(v))
        self._kb[:, :, :n, ...] = k
        self._vb[:, :, :n, ...] = v
        self._off = 0
        self.k = self._kb[:, :, :n, ...]
        self.v = self._vb[:, :, :n, ...]

    def holds(self, k: Array) -> bool:
        """Whether ``k`` is this object's current key block (the same array object)."""
        return k is self.k

    @property
    def key_rows(self) -> Array:
        """The key buffer, whole: rows ``[offset, offset + n)`` are the block."""
        return self._kb

    @property
    def value_rows(self) -> Array:
        """The value buffer, whole."""
        return self._vb

    @property
    def offset(self) -> int:
        """Buffer row of the block's first row."""
        return self._off

    def room(self, t: int) -> int:
        """Buffer row after the block with ``t`` free rows from it on (the block moved back to
        the buffer's start, or into a larger buffer, when the spare rows run out).

        The block's content is unchanged; its views ``k``, ``v`` are renewed when it moved.
        A caller writes the arriving rows there, then calls :meth:`advance`.
        """
        n = int(self.k.shape[2])
        cap = int(self._kb.shape[2])
        off = self._off
        if off + n + t > cap:
            if n + t > cap:
                self._grow(n + t)
            else:
                _move(self._kb, 0, off, n)
                _move(self._vb, 0, off, n)
                self._off = 0
                self.k = self._kb[:, :, :n, ...]
                self.v = self._vb[:, :, :n, ...]
        return self._off + n

    def advance(self, head: int, drop: int, t: int) -> tuple:
        """``(k, v)``: the block ``rows[:head] ++ rows[head + drop:] ++ arrived``, where the ``t``
        arrived rows were written at :meth:`room`'s row. The head rows move forward over the
        dropped ones; the previous views are invalid afterwards."""
        off = self._off
        end = off + int(self.k.shape[2])
        if head and drop:
            _move(self._kb, off + drop, off, head)
            _move(self._vb, off + drop, off, head)
        off += drop
        self._off = off
        self.k = self._kb[:, :, off : end + t, ...]
        self.v = self._vb[:, :, off : end + t, ...]
        return self.k, self.v

    def slide(self, head: int, drop: int, k_new: Array, v_new: Array) -> tuple:
        """``(k, v)``: the block ``rows[:head] ++ rows[head + drop:] ++ new``, written in place.

        ``k_new``, ``v_new`` (batch, heads, t, head_dim) in the block's dtype. The previous
        views are invalid afterwards. ``head + drop`` must not exceed the block's rows.
        """
        t = int(k_new.shape[2])
        row = self.room(t)
        self._kb[:, :, row : row + t, ...] = k_new
        self._vb[:, :, row : row + t, ...] = v_new
        return self.advance(head, drop, t)

    def _grow(self, rows: int) -> None:
        """New buffers holding the block with room for ``rows`` rows and ``SPARE_ROWS`` more."""
        fresh = SlidingRows(namespace(self._kb), self.k, self.v, spare=rows - int(self.k.shape[2]) + SPARE_ROWS)
        self._kb, self._vb, self._off, self.k, self.v = fresh._kb, fresh._vb, 0, fresh.k, fresh.v

    def mark(self) -> tuple:
        """What :meth:`rewind` needs to put this block back where it is now: the buffers, the
        offset and a copy of the block's rows (the rows a later step may overwrite)."""
        return (self._kb, self._vb, self._off, copied(self.k), copied(self.v))

    def rewind(self, mark: tuple) -> None:
        """The block of :meth:`mark` again, in the same buffers at the same offset (the rows
        written back), so that what reads it sees the same memory as before; new views."""
        kb, vb, off, k, v = mark
        n = int(k.shape[2])
        kb[:, :, off : off + n, ...] = k
        vb[:, :, off : off + n, ...] = v
        self._kb, self._vb, self._off = kb, vb, off
        self.k = kb[:, :, off : off + n, ...]
        self.v = vb[:, :, off : off + n, ...]

    def spare_nbytes(self) -> int:
        """Bytes of the buffers outside the current block."""
        return array_nbytes(self._kb) + array_nbytes(self._vb) - array_nbytes(self.k) - array_nbytes(self.v)


def copied(x: Array) -> Array:
    """A copy of ``x``: a plain NumPy array's own ``copy`` (a tenth of the array-API call's
    cost for the few rows of a window, paid by every decode step's undo record), else
    ``xp.asarray(x, copy=True)``."""
    return x.copy() if plain_numpy(x) else namespace(x).asarray(x, copy=True)


def _move(buf: Array, dst: int, src: int, rows: int) -> None:
    """Rows ``src .. src + rows`` of ``buf`` (axis 2) copied to ``dst ..``; the ranges may overlap.

    NumPy's assignment reads overlapping operands as if copied first; other libraries get an
    explicit copy of the source rows when the ranges overlap.
    """
    part = buf[:, :, src : src + rows, ...]
    if abs(dst - src) < rows and type(buf).__module__ != "numpy":
        part = namespace(buf).asarray(part, copy=True)
    buf[:, :, dst : dst + rows, ...] = part
