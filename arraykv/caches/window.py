"""Tokens a compressed cache keeps exactly: attention sinks and a recent-token window.

The ``pqo``/``pq``/``tq`` and ``lowrank``/``vq`` caches hold the first ``sink_tokens`` tokens
of a sequence and its latest ``residual_window`` tokens in float16 (float32 where the
namespace has no float16), and encode the tokens between them. :class:`ExactTokens` is that
float16 block, sinks first, and :meth:`ExactTokens.step` plans one store: which new tokens
become sinks, which tokens leave the window (oldest first) to be encoded, and the block
afterwards. Nothing is changed until the cache commits the block the plan returns, so a store
that fails while encoding leaves the layer as it was.

The integer caches do not use it: their keys wait in a residual until a quantization group
of ``group_size`` tokens fills (KIVI's schedule), which is a different rule from a sliding
window (:mod:`arraykv.caches.intq`).

A saved layer of these caches is checked before it is rebuilt (:mod:`arraykv.caches.layout`):
:func:`rollback_layout` is its rollback copies and ``fixed_end``, and :func:`token_counts`
the rule its token counts follow (``min(sink_tokens, n)`` sinks, then the codes, then a
window of ``min(residual_window, n − sinks)`` tokens once calibrated; every token exact,
without codes or copies, before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .._compat import array_nbytes
from .._types import Array, Device, Namespace
from ..quant.polar import half_dtype
from ..storage import TokenBuffers
from .layer import LayerState, refuse_overflow
from .layout import Layout, Spec, fixed_end_spec
from .rollback import RECORD_NBYTES, keep_last
from .sliding import SlidingRows

__all__ = [
    "ExactTokens",
    "WindowStep",
    "WindowLayer",
    "WindowRollback",
    "commit_store",
    "restore_tokens",
    "rollback_arrays",
    "restore_rollback",
    "sliding_rows",
    "block_room",
    "rollback_room",
    "rollback_layout",
    "token_counts",
]


def _f32(xp: Namespace, x: Array) -> Array:
    return x if x.dtype == xp.float32 else xp.astype(x, xp.float32)


@dataclass(frozen=True)
class ExactTokens:
    """The float16 tokens of one layer: the sinks, then the recent window.

    Attributes
    ----------
    k, v : array, float16 (batch, kv_heads, n_sink + n_recent, head_dim)
        Rows ``:n_sink`` are the first tokens of the sequence; the rest are the latest tokens,
        oldest first. A decode kernel may read the block as one set of exact tokens.
    n_sink : int
        Sink tokens held.
    """

    k: Array
    v: Array
    n_sink: int = 0

    @classmethod
    def empty(cls, xp: Namespace, dev: Device, batch: int, heads: int, head_dim: int) -> ExactTokens:
        """No token: blocks of shape (batch, heads, 0, head_dim) in the namespace's half dtype."""
        z = xp.zeros((batch, heads, 0, head_dim), dtype=half_dtype(xp), device=dev)
        return cls(k=z, v=z, n_sink=0)

    @classmethod
    def from_parts(cls, xp: Namespace, k_sink: Array, v_sink: Array, k_recent: Array, v_recent: Array) -> ExactTokens:
        """The block of separately held sinks and recent tokens (each (b, h, n, d))."""
        n = int(k_sink.shape[2])
        if not n:
            return cls(k=k_recent, v=v_recent, n_sink=0)
        if not int(k_recent.shape[2]):
            return cls(k=k_sink, v=v_sink, n_sink=n)
        return cls(k=xp.concat([k_sink, k_recent], axis=2), v=xp.concat([v_sink, v_recent], axis=2), n_sink=n)

    @property
    def count(self) -> int:
        """Tokens held (sinks and recent)."""
        return int(self.k.shape[2])

    @property
    def n_recent(self) -> int:
        """Recent (window) tokens held."""
        return self.count - self.n_sink

    def sinks(self) -> tuple:
        """``(k, v)`` of the sink tokens (views)."""
        return self.k[:, :, : self.n_sink, :], self.v[:, :, : self.n_sink, :]

    def recent(self) -> tuple:
        """``(k, v)`` of the recent tokens (views)."""
        return self.k[:, :, self.n_sink :, :], self.v[:, :, self.n_sink :, :]

    def nbytes(self) -> int:
        """Bytes of the two blocks."""
        return array_nbytes(self.k) + array_nbytes(self.v)

    def step(self, xp: Namespace, k: Array, v: Array, q: Array | None = None, *, sink_tokens: int) -> WindowStep:
        """Plan the store of new tokens ``k``, ``v`` (b, h, t, d): the first become sinks while
        fewer than ``sink_tokens`` are held; the rest follow the recent window.

        ``q`` (b, q_heads, t, d), if given, is cut the same way (its rows for the sink tokens
        dropped), for caches that calibrate on the queries of the window tokens.
        """
        half = half_dtype(xp)
        ks, vs = self.sinks()
        take = min(sink_tokens - self.n_sink, int(k.shape[2]))
        if take > 0:
            ks = xp.concat([ks, xp.astype(k[:, :, :take, :], half)], axis=2)
            vs = xp.concat([vs, xp.astype(v[:, :, :take, :], half)], axis=2)
            k, v = k[:, :, take:, :], v[:, :, take:, :]
            if q is not None:
                q = q[:, :, take:, :]
        kw, vw = self.recent()
        return WindowStep(xp=xp, k_sink=ks, v_sink=vs, k_recent=kw, v_recent=vw, k=k, v=v, q=q, taken=max(0, take))


@dataclass(frozen=True)
class WindowStep:
    """One store in progress: sinks taken, the recent window and the new tokens after them.

    The tokens in store order are ``recent ++ new``; :meth:`first` converts a prefix of them
    to float32 (the ones to encode, or to fit on), :meth:`block` returns the
    :class:`ExactTokens` left once ``spill`` of them have left the window.
    """

    xp: Namespace
    k_sink: Array
    v_sink: Array
    k_recent: Array
    v_recent: Array
    k: Array
    v: Array
    q: Array
    taken: int

    @property
    def n_recent(self) -> int:
        """Window tokens held before this store."""
        return int(self.k_recent.shape[2])

    @property
    def n_new(self) -> int:
        """New tokens that go to the window (after the sinks)."""
        return int(self.k.shape[2])

    @property
    def n_sink(self) -> int:
        """Sink tokens after this store."""
        return int(self.k_sink.shape[2])

    def spill(self, window: int) -> int:
        """Tokens that leave a window of ``window`` tokens in this store (oldest first)."""
        return max(0, self.n_recent + self.n_new - window)

    def first(self, n: int) -> tuple:
        """``(k, v)``: the first ``n`` tokens of ``recent ++ new`` as float32 (b, h, n, d); only those are converted."""
        return self._first(self.k_recent, self.k, n), self._first(self.v_recent, self.v, n)

    def _first(self, held: Array, new: Array, n: int) -> Array:
        xp = self.xp
        a = min(n, int(held.shape[2]))
        parts = [_f32(xp, held[:, :, :a, :])] if a else []
        if n > a:
            parts.append(_f32(xp, new[:, :, : n - a, :]))
        if not parts:
            return _f32(xp, held[:, :, :0, :])
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=2)

    def block(self, spill: int) -> ExactTokens:
        """The exact tokens after ``spill`` tokens of ``recent ++ new`` left the window."""
        xp = self.xp
        half = half_dtype(xp)
        n_w, t = self.n_recent, self.n_new
        drop = min(spill, n_w)
        keep_new = t - max(0, spill - n_w)
        k = xp.concat(
            [self.k_sink, self.k_recent[:, :, drop:, :], xp.astype(self.k[:, :, t - keep_new :, :], half)], axis=2
        )
        v = xp.concat(
            [self.v_sink, self.v_recent[:, :, drop:, :], xp.astype(self.v[:, :, t - keep_new :, :], half)], axis=2
        )
        return ExactTokens(k=k, v=v, n_sink=self.n_sink)

    def half_rows(self, lo: int, hi: int) -> tuple:
        """``(k, v)``: tokens ``lo .. hi - 1`` of ``recent ++ new`` in the half dtype (the window's form of them)."""
        xp = self.xp
        half = half_dtype(xp)
        n_w = self.n_recent
        ks = [self.k_recent[:, :, min(lo, n_w) : min(hi, n_w), :]]
        vs = [self.v_recent[:, :, min(lo, n_w) : min(hi, n_w), :]]
        if hi > n_w:
            a = max(0, lo - n_w)
            ks.append(xp.astype(self.k[:, :, a : hi - n_w, :], half))
            vs.append(xp.astype(self.v[:, :, a : hi - n_w, :], half))
        if len(ks) == 1:
            return ks[0], vs[0]
        return xp.concat(ks, axis=2), xp.concat(vs, axis=2)

    def added_rows(self, exact: ExactTokens, spill: int) -> tuple:
        """``(k, v)``: the rows of ``exact`` (from :meth:`block`) that this store converted, as
        lists of views (the sinks it took, the new tokens it keeps in the window)."""
        keep_new = self.n_new - max(0, spill - self.n_recent)
        ks, vs = [], []
        if self.taken:
            ks.append(exact.k[:, :, self.n_sink - self.taken : self.n_sink, :])
            vs.append(exact.v[:, :, self.n_sink - self.taken : self.n_sink, :])
        if keep_new:
            ks.append(exact.k[:, :, exact.count - keep_new :, :])
            vs.append(exact.v[:, :, exact.count - keep_new :, :])
        return ks, vs


@dataclass
class WindowLayer(LayerState):
    """A layer with sinks, encoded tokens and a recent window (polar, ``lowrank``, ``vq``).

    Attributes
    ----------
    codes : TokenBuffers
        The encoded tokens' arrays, token axis 2.
    exact : ExactTokens
        The sink tokens, then the recent window, in float16.
    calib : object or None
        The layer's calibration (the cache's type), None before it is made.
    rollback : ExactTokens
        float16 copies of the last ``rollback_tokens`` encoded tokens (for ``truncate``).
    window_rows, rollback_rows : SlidingRows or None
        The buffers ``exact`` and ``rollback`` are views of once stores slide them in place
        (:func:`commit_store`); stale when those fields hold other arrays (:func:`sliding_rows`).
    """

    codes: TokenBuffers = None  # type: ignore[assignment]  # set when the layer is created
    exact: ExactTokens = None  # type: ignore[assignment]
    calib: Any = None
    rollback: ExactTokens = None  # type: ignore[assignment]
    window_rows: SlidingRows | None = None
    rollback_rows: SlidingRows | None = None
    #: Token buffers appended to, float16 blocks, a calibration replaced whole (see LayerState).
    undo: ClassVar[str] = "fields"

    def buffers(self) -> tuple:
        return (self.codes,)


def sliding_rows(st: WindowLayer, name: str, held: ExactTokens) -> SlidingRows:
    """The layer's :class:`SlidingRows` ``name`` (``"window_rows"``, ``"rollback_rows"``) holding the
    block ``held``; made from ``held`` (a copy) when the field holds another block or none."""
    rows: SlidingRows | None = getattr(st, name)
    if rows is None or not rows.holds(held.k):
        rows = SlidingRows(st.xp, held.k, held.v)
        setattr(st, name, rows)
    return rows


_SLIDING = {"exact": "window_rows", "rollback": "rollback_rows"}


def block_room(st: WindowLayer, which: str, rows: int) -> tuple[SlidingRows, int, Callable[[int], None]]:
    """Room for ``rows`` more rows after the block ``which`` of layer ``st`` (``"exact"``: the
    sinks and window; ``"rollback"``: the rollback copies), in two steps for atomic stores.

    Returns ``(block, row, push)``: rows ``row .. row + rows`` of ``block.key_rows`` /
    ``block.value_rows`` (a :class:`SlidingRows`) are to be written; ``push(drop)`` then takes
    them into use and drops the ``drop`` oldest rows after the sinks. Making the room is the
    only step that may allocate (the block stays the same rows, as renewed views); ``push``
    allocates nothing.
    """
    held = getattr(st, which)
    n_sink = held.n_sink
    block = sliding_rows(st, _SLIDING[which], held)
    row = block.room(rows)
    if block.k is not held.k:  # the same rows, moved: renewed views
        setattr(st, which, ExactTokens(k=block.k, v=block.v, n_sink=n_sink))

    def push(drop: int) -> None:
        k, v = block.advance(n_sink, drop, rows)
        setattr(st, which, ExactTokens(k=k, v=v, n_sink=n_sink))

    return block, row, push


def rollback_room(st: WindowLayer, rows: int, keep: int) -> tuple[SlidingRows, int, Callable[[], None]]:
    """:func:`block_room` of the rollback copies; its ``push()`` drops the oldest copies beyond ``keep``."""
    block, row, push = block_room(st, "rollback", rows)
    return block, row, lambda: push(max(0, st.rollback.count + rows - keep))


def commit_store(
    xp: Namespace,
    method: str,
    st: WindowLayer,
    step: WindowStep,
    spill: int,
    arrays: dict | None,
    calib: Any,
    new_calib: dict,
    rollback: int = 0,
) -> None:
    """Commit a planned store to layer ``st``.

    ``step`` is the plan (:meth:`ExactTokens.step`) and ``spill`` the tokens of ``recent ++
    new`` that leave the window, ``arrays`` those tokens encoded (None: none left), ``calib``
    the layer's calibration afterwards, ``new_calib`` its arrays by name when this store made it
    (else empty; the layer's ``fixed_end`` becomes the end of this store), ``rollback`` the
    rollback copies kept: the half-precision form of the last ``rollback`` tokens encoded
    (:mod:`arraykv.caches.rollback`). What this store adds in float is checked for float16
    overflow first (:func:`~arraykv.caches.layer.refuse_overflow`; the rows already held were
    checked when they were stored): a refused store changes nothing, and neither does one
    whose allocations fail.

    Notes
    -----
    A store that takes no sink slides the window in place (:class:`SlidingRows`): the rows
    that arrive are written after the block and the sinks move forward over the rows that
    leave, the same block a concatenation would build, without allocating one per store. The
    rollback copies slide the same way. Every allocation comes first (room for the rows in
    both buffers, then the encoded tokens' append); the rows written into that room are not
    part of a block until the last step, which allocates nothing. A store that takes sinks
    builds the block anew (only the first ``sink_tokens`` tokens do).
    """
    if step.taken:
        finish = _new_block(xp, method, st, step, spill, arrays, new_calib, rollback)
    else:
        finish = _sliding_block(xp, method, st, step, spill, arrays, new_calib, rollback)
    if arrays is not None:
        st.codes.append(arrays)
    finish()
    if new_calib:
        st.fixed_end = st.length + step.taken + step.n_new
    st.calib = calib


def _new_block(
    xp: Namespace,
    method: str,
    st: WindowLayer,
    step: WindowStep,
    spill: int,
    arrays: dict | None,
    new_calib: dict,
    rollback: int,
) -> Callable[[], None]:
    """:func:`commit_store`'s window and rollback copies by concatenation; returns the commit."""
    exact = step.block(spill)
    k_new, v_new = step.added_rows(exact, spill)
    margin = st.rollback
    if spill and rollback:
        kr, vr = step.half_rows(max(0, spill - rollback), spill)
        if spill > step.n_recent:  # rows of new tokens among them (rows of the held window were checked)
            k_new, v_new = k_new + [kr], v_new + [vr]
        margin = ExactTokens(k=keep_last(xp, margin.k, kr, rollback), v=keep_last(xp, margin.v, vr, rollback))
    refuse_overflow(xp, method, {"window": k_new, "value window": v_new, **(arrays or {}), **new_calib})

    def finish() -> None:
        st.exact, st.rollback = exact, margin

    return finish


def _sliding_block(
    xp: Namespace,
    method: str,
    st: WindowLayer,
    step: WindowStep,
    spill: int,
    arrays: dict | None,
    new_calib: dict,
    rollback: int,
) -> Callable[[], None]:
    """:func:`commit_store`'s window and rollback copies slid in place (no sink taken): the
    checks and every allocation; returns the commit, which allocates nothing."""
    half = half_dtype(xp)
    n_w, t = step.n_recent, step.n_new
    keep_new = t - max(0, spill - n_w)  # new tokens that stay in the window
    k_new = xp.astype(step.k[:, :, t - keep_new :, :], half)
    v_new = xp.astype(step.v[:, :, t - keep_new :, :], half)
    k_check, v_check = [k_new], [v_new]
    kr = vr = None
    if spill and rollback:
        kr, vr = step.half_rows(max(0, spill - rollback), spill)
        if spill > n_w:  # rows of new tokens among them (rows of the held window were checked)
            k_check, v_check = k_check + [kr], v_check + [vr]
    refuse_overflow(xp, method, {"window": k_check, "value window": v_check, **(arrays or {}), **new_calib})
    push = None
    if kr is not None:  # copied into the spare rows before the window's buffer moves
        r = int(kr.shape[2])
        margin, mrow, push = rollback_room(st, r, rollback)
        margin.key_rows[:, :, mrow : mrow + r, ...] = kr
        margin.value_rows[:, :, mrow : mrow + r, ...] = vr
    window, row, slide = block_room(st, "exact", keep_new)

    def finish() -> None:
        if push is not None:
            push()
        window.key_rows[:, :, row : row + keep_new, ...] = k_new
        window.value_rows[:, :, row : row + keep_new, ...] = v_new
        slide(min(spill, n_w))

    return finish


def restore_tokens(st: Any, arrays: dict, per_token: tuple, exact: ExactTokens, length: int) -> None:
    """Put a saved layer's encoded tokens (the ``per_token`` names in ``arrays``) and exact block
    into the fresh layer ``st``; ``ValueError`` unless they hold ``length`` tokens together."""
    codes = {n: arrays[n] for n in per_token if n in arrays}
    if codes and int(next(iter(codes.values())).shape[2]):
        st.codes.append(codes)
    st.exact = exact
    held = st.codes.length + exact.count
    if held != length:
        raise ValueError(f"stored arrays hold {held} tokens, expected {length}")
    st.length = length


class WindowRollback:
    """Truncation of a layer with sinks, codes, a recent window and rollback copies (polar,
    ``lowrank``, ``vq``): a mixin before :class:`~arraykv.caches.LayeredCache`, for caches with
    ``sink_tokens``, ``residual_window``, ``rollback_tokens`` and the hook
    ``_uncalibrated_at(state, length)`` (whether a direct build of ``length`` tokens has made
    no calibration yet).

    Notes
    -----
    A layer of ``n`` tokens holds ``n_s = min(sink_tokens, n)`` sinks, then ``c`` encoded
    tokens, then ``w = min(n − n_s, residual_window)`` window tokens (all ``n − n_s`` before the
    layer is calibrated), and float16 copies of its last ``M`` encoded tokens: positions
    ``lo = n_s + c − M .. n − 1`` are held exactly. At length ``L`` a direct build holds
    ``n_s' = min(n_s, L)`` sinks, ``w'`` window tokens by the same rule and ``c' = L − n_s' − w'``
    codes, the same codes as the first ``c'`` here (same calibration, same positions). So ``L``
    is reachable when its window ``n_s' + c' .. L − 1`` starts at ``lo`` or later (or is empty),
    and when ``L`` is not inside the calibrating call (``L >= fixed_end``).

    Below ``fixed_end`` a direct build calibrates on other tokens, or not at all: when it has
    not calibrated yet (``_uncalibrated_at``; for polar ``L − n_s' <= residual_window``: its
    window never spilled), it holds all ``L`` tokens exactly (sinks, then window), no code, no
    calibration, no copies. That state is rebuilt when the layer's calibration was made by one
    of its calls (not given: ``fixed_end > 0``; where a calibration may be given, also
    recorded: ``fixed_known``; polar layers calibrate only when their window spills, so any
    of theirs was) and every window token of it is
    held exactly (``n_s' >= lo``: the copies reach back to the first encoded token, or there is
    no window token). So the lengths reachable are 0, ``1 .. U`` (those uncalibrated ones, and
    the sinks-only ones) and ``F .. n`` (above the calibrating call), two intervals that may
    meet.
    """

    #: Whether a calibration may be given rather than made by a call (``lowrank``/``vq``): a
    #: layer whose file did not record its calibrating call is then never uncalibrated.
    _calibration_given: bool = True
    #: Set by the cache (its option).
    residual_window: int
    #: The cache's hook: whether a direct build of ``length`` tokens has made no calibration yet.
    _uncalibrated_at: Callable[[Any, int], bool]

    def _cut(self, st: Any, length: int, calibrated: bool = True) -> tuple:
        """``(n_s', w', c', lo)`` of a truncation of ``st`` to ``length`` (see Notes);
        ``calibrated=False``: into the uncalibrated state (every token in the window)."""
        ns = st.exact.n_sink
        ns2 = min(ns, length)
        w2 = length - ns2 if st.calib is None or not calibrated else min(length - ns2, self.residual_window)
        return ns2, w2, length - ns2 - w2, ns + st.codes.length - st.rollback.count

    def _uncalibrating(self, st: Any, length: int) -> bool:
        """Whether a truncation of calibrated ``st`` to ``length`` must drop the calibration."""
        return 0 < length < st.fixed_end and st.calib is not None

    def _reachable(self, st: Any, length: int) -> bool:
        """Whether a truncation of ``st`` to ``0 < length < st.length`` is exact (see Notes)."""
        if st.calib is None:
            return True  # every token is held exactly
        if length >= st.fixed_end:
            ns2, w2, c2, lo = self._cut(st, length)
            return not (w2 and ns2 + c2 < lo)
        if not ((st.fixed_known or not self._calibration_given) and self._uncalibrated_at(st, length)):
            return False  # a direct build calibrates on other tokens (or it may have been given)
        ns2, w2, _, lo = self._cut(st, length, calibrated=False)
        return not w2 or ns2 >= lo

    def _reach(self, st: Any) -> tuple:
        """``(U, F)``: lengths ``1 .. U`` and ``F .. n`` are reachable, no other above 0 (U may be 0)."""
        n = st.length
        if st.calib is None:
            return n, n
        top = max(1, st.fixed_end)
        if self.residual_window:  # the scan fails within rollback_tokens + window steps
            for length in range(n - 1, top - 1, -1):
                if not self._reachable(st, length):
                    top = length + 1
                    break
        low = 0
        while low + 1 < top and self._reachable(st, low + 1):  # sinks and the uncalibrated lengths
            low += 1
        return low, min(top, n)

    def _truncate_floor(self, st: Any) -> int:
        low, top = self._reach(st)
        return 1 if low + 1 >= top else top

    def _reach_ranges(self, st: Any) -> list:
        low, top = self._reach(st)
        if low + 1 >= top:
            return [(1, st.length)]
        return ([(1, low)] if low else []) + [(top, st.length)]

    def _truncate_plan(self, st: Any, length: int) -> Callable[[], None]:
        xp = st.xp
        uncal = self._uncalibrating(st, length)
        ns2, w2, c2, lo = self._cut(st, length, calibrated=not uncal)
        ks, vs = st.exact.sinks()
        kw, vw = st.exact.recent()
        if w2:
            held = st.rollback.count
            kw = xp.concat([st.rollback.k, kw], axis=2) if held else kw
            vw = xp.concat([st.rollback.v, vw], axis=2) if held else vw
            kw, vw = kw[:, :, ns2 + c2 - lo : length - lo, :], vw[:, :, ns2 + c2 - lo : length - lo, :]
        else:
            kw, vw = kw[:, :, :0, :], vw[:, :, :0, :]
        exact = ExactTokens.from_parts(xp, ks[:, :, :ns2, :], vs[:, :, :ns2, :], kw, vw)
        keep = 0 if uncal else max(0, st.rollback.count - (st.codes.length - c2))
        margin = ExactTokens(k=st.rollback.k[:, :, :keep, :], v=st.rollback.v[:, :, :keep, :])
        plan = st.codes.truncate_plan(c2)

        def commit() -> None:
            st.codes.commit_truncate(plan)
            st.exact, st.rollback = exact, margin
            if uncal:  # the direct build has not calibrated: a later spill calibrates as it would
                st.calib, st.fixed_end, st.fixed_known = None, 0, True

        return commit

    def _rollback_nbytes(self, st: Any) -> int:
        held: int = st.rollback.nbytes()
        return held + RECORD_NBYTES

    def _side_spare_nbytes(self, st: WindowLayer) -> int:
        """The spare rows of the buffers the window and the rollback copies slide in."""
        return sum(
            rows.spare_nbytes()
            for rows, held in ((st.window_rows, st.exact), (st.rollback_rows, st.rollback))
            if rows is not None and rows.holds(held.k)
        )


def rollback_arrays(st: Any) -> dict:
    """The saved arrays of a window layer's rollback state: ``k_rollback``, ``v_rollback`` and
    ``fixed_end`` (int64, shape (1,); left out when the layer does not know it, having been
    loaded from a file without it: the file then loads as such a file again)."""
    out = {"k_rollback": st.rollback.k, "v_rollback": st.rollback.v}
    if st.fixed_known:
        out["fixed_end"] = st.xp.asarray([st.fixed_end], dtype=st.xp.int64, device=st.device)
    return out


def restore_rollback(st: Any, arrays: dict) -> None:
    """Put saved rollback state into layer ``st`` (after its calibration is restored). A file
    written before rollback copies existed has none: the layer can then only be truncated to 0
    until tokens are encoded, and not below its length at all if it is calibrated (its
    ``fixed_end`` is taken to be that length, and marked unknown: ``fixed_known`` False, so a
    ``lowrank``/``vq`` layer, whose calibration may have been given, is never uncalibrated by a
    truncation)."""
    xp = st.xp
    if "k_rollback" in arrays:
        st.rollback = ExactTokens(
            k=xp.asarray(arrays["k_rollback"], copy=True), v=xp.asarray(arrays["v_rollback"], copy=True)
        )
    if "fixed_end" in arrays:
        st.fixed_end = int(arrays["fixed_end"][0])
    elif st.calib is not None:
        st.fixed_end, st.fixed_known = st.length, False


def rollback_layout(xp: Namespace, batch: int, heads: int, head_dim: int) -> Layout:
    """The :class:`~arraykv.caches.layout.Layout` of the saved rollback state of a window layer:
    ``k_rollback``, ``v_rollback`` (half, (b, h, ``"copies"``, d), together; absent in files
    written before rollback copies existed) and ``fixed_end``."""
    half = half_dtype(xp)
    return Layout(
        arrays={
            "k_rollback": Spec(half, (batch, heads, "copies", head_dim), required=False),
            "v_rollback": Spec(half, (batch, heads, "copies", head_dim), required=False),
            "fixed_end": fixed_end_spec(xp),
        },
        groups=(("k_rollback", "v_rollback"),),
    )


def token_counts(
    cache: Any,
    length: int,
    n_sink: int,
    n_recent: int,
    n_codes: int,
    copies: int,
    calibrated: bool,
    *,
    spill_calibrates: bool,
) -> str | None:
    """A message when a saved window layer's token counts are not those of a layer of ``length``
    tokens of ``cache`` (``sink_tokens``, ``residual_window``, ``rollback_tokens``), else None.

    ``spill_calibrates``: the cache calibrates a layer the first time its window spills (polar),
    so an uncalibrated layer holds at most ``residual_window`` tokens after its sinks.
    """
    window, sinks = cache.residual_window, min(cache.sink_tokens, length)
    if n_sink != sinks or n_recent < 0 or n_sink + n_codes + n_recent != length:
        return (
            f"stored arrays hold {n_sink} sink, {n_codes} encoded and {n_recent} window tokens; a layer of "
            f"{length} tokens holds {sinks} sinks and {length - sinks} more"
        )
    if calibrated and n_recent != min(window, length - sinks):
        return (
            f"stored window holds {n_recent} tokens; a calibrated layer of {length} tokens holds "
            f"{min(window, length - sinks)}"
        )
    if not calibrated and (n_codes or copies or (spill_calibrates and n_recent > window)):
        return (
            "stored arrays hold encoded tokens, rollback copies or a spilled window but no calibration"
            if n_codes or copies
            else f"an uncalibrated layer holds at most residual_window={window} window tokens, received {n_recent}"
        )
    if copies > min(cache.rollback_tokens, n_codes):
        return (
            f"stored rollback copies hold {copies} tokens; at most {min(cache.rollback_tokens, n_codes)} "
            f"(rollback_tokens={cache.rollback_tokens}, {n_codes} encoded)"
        )
    return None
