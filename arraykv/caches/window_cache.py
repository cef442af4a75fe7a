"""A cache for sliding-window attention layers: only the last ``window`` tokens are held.

A sliding-window layer (Gemma 2/3's local layers, Mistral-style windows) lets the token at
position ``p`` attend to positions ``p - window + 1 .. p`` only. Everything older can never be
read again, so the layer's memory is bounded by the window, whatever the context length: at
Gemma-3-270M's 32k context its 15 local layers hold 512 tokens each while its 3 global layers
hold all 32k. Such a bounded layer is held exactly (float16 by default, or in the input dtype),
which costs little beside the global layers and keeps the local attention lossless.

Positions: ``seq_len`` counts every token ever stored (the position of the next token), while
the layer holds the last ``held`` of them; what ``prefill`` and ``decode`` return is the held
tokens, the *last* ``n`` positions of the sequence, and the caller masks by position
(:func:`arraykv.integrations.llama_attention.window_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._validation import check_int
from ..protocol import AttendConfig, Dequantized, DequantResult
from .base import LayeredCache, LayerState, refuse_overflow
from .registry import register_method
from .rollback import DEFAULT_ROLLBACK_TOKENS, check_rollback_tokens

__all__ = ["SlidingWindowCache", "WindowLayer", "WINDOW_STORAGE"]

#: How a window layer holds its tokens: float16 (half the bytes of float32, range ±65504) or
#: exactly as given.
WINDOW_STORAGE = ("float16", "exact")


@dataclass
class WindowLayer(LayerState):
    """One layer of a :class:`SlidingWindowCache`.

    Attributes
    ----------
    kb, vb : array, shape (batch, kv_heads, capacity, head_dim)
        Buffers; rows ``off .. off + n`` are the held tokens, oldest first.
    off, n : int
        First held row and the number of rows held (the last ``n`` positions, ``n <= length``).
    """

    kb: Any = None
    vb: Any = None
    off: int = 0
    n: int = 0

    def held(self) -> tuple:
        """Views of the held keys and values, (batch, kv_heads, n, head_dim)."""
        return self.kb[:, :, self.off:self.off + self.n, :], self.vb[:, :, self.off:self.off + self.n, :]


@register_method("window", generic=True)
class SlidingWindowCache(LayeredCache):
    """Keys and values of the last ``window + rollback_tokens`` tokens of each layer.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
    window : int
        The attention span: a token sees itself and the ``window - 1`` tokens before it.
    rollback_tokens : int, default 16
        Extra tokens held so that :meth:`truncate` can take that many back.
    storage : {"float16", "exact"}, default "float16"
        ``"float16"`` holds half the bytes of float32 (a value beyond ±65504 is refused, as
        in every float16 part of the compressed caches); ``"exact"`` holds the input dtype.
    check_finite, max_tokens
        As for every cache; ``max_tokens`` bounds the positions, not the rows held.

    Notes
    -----
    ``prefill`` returns the tokens held before the call and the new ones, ``(batch, kv_heads,
    n, head_dim)`` for the last ``n`` positions; a causal chunk of queries masks them by the
    window. ``decode`` returns exactly the last ``window`` tokens (fewer at the start), so
    attention over them needs no mask. Truncating is exact for attention: a layer truncated to
    ``L`` attends as the direct build of ``L`` tokens does, but holds fewer rows of the past
    (the rows a direct build would hold in its rollback margin are gone), so its saved arrays
    are shorter. Lengths from ``seq_len - rollback_tokens`` (and 0) are reachable.
    """

    method = "window"
    #: Held as given (or float16): a prompt needs no exact staging.
    stores_exactly = True

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, window: int,
                 rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS, storage: str = "float16",
                 check_finite: bool = True, max_tokens: int | None = None):
        super().__init__(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         check_finite=check_finite, max_tokens=max_tokens)
        self.window = check_int("window", window, low=1)
        self.rollback_tokens = check_rollback_tokens(rollback_tokens)
        if not isinstance(storage, str) or storage not in WINDOW_STORAGE:
            raise ValueError(f"storage must be one of {', '.join(WINDOW_STORAGE)}, received {storage!r}")
        self.storage = storage
        #: Rows a layer keeps after every call.
        self.keep = self.window + self.rollback_tokens
        #: Rows of a layer's buffers at most: ``keep`` plus room for ``max(16, keep // 4)`` more, so
        #: the held rows move back to the buffers' start once every that many decode steps. The
        #: buffers start small and double up to it.
        self.capacity = self.keep + max(16, self.keep // 4)

    # -- storing -----------------------------------------------------------------------
    def _new_layer(self, xp, dev, batch, dtype) -> WindowLayer:
        return WindowLayer(xp=xp, device=dev, batch=batch, dtype=dtype)

    def _stored(self, st: WindowLayer, k: Any, v: Any) -> tuple:
        """``k``, ``v`` in the storage dtype, refused before anything changes if float16 overflows."""
        if self.storage == "exact":
            return k, v
        xp = st.xp
        k16, v16 = xp.astype(k, xp.float16), xp.astype(v, xp.float16)
        refuse_overflow(xp, self.method, {"k": k16, "v": v16})
        return k16, v16

    def _push(self, st: WindowLayer, k: Any, v: Any) -> None:
        """Append stored-dtype rows and drop the oldest beyond ``keep``: amortized O(rows) per call."""
        xp, keep, t = st.xp, self.keep, int(k.shape[2])
        cap = 0 if st.kb is None else int(st.kb.shape[2])
        if t >= keep or st.kb is None or (st.off + st.n + t > cap and cap < self.capacity):
            # a new buffer: the first rows, a chunk longer than what is kept, or growth towards the
            # capacity (doubling, so a short sequence holds little and a long one moves rarely)
            old = 0 if st.kb is None else min(st.n, keep - min(t, keep))
            m = min(t, keep)
            cap = min(self.capacity, max(64, 2 * (old + m)))
            shape = (st.batch, self.num_kv_heads, cap, self.head_dim)
            kb = xp.empty(shape, dtype=k.dtype, device=st.device)
            vb = xp.empty(shape, dtype=v.dtype, device=st.device)
            if old:
                hk, hv = st.held()
                kb[:, :, :old, :] = hk[:, :, st.n - old:, :]
                vb[:, :, :old, :] = hv[:, :, st.n - old:, :]
            kb[:, :, old:old + m, :] = k[:, :, t - m:, :]
            vb[:, :, old:old + m, :] = v[:, :, t - m:, :]
            st.kb, st.vb, st.off, st.n = kb, vb, 0, old + m
            return
        if st.off + st.n + t > cap:  # full capacity: move the rows that survive to the buffer's start
            old = min(st.n, keep - t)
            src = st.off + st.n - old
            st.kb[:, :, :old, :] = xp.asarray(st.kb[:, :, src:src + old, :], copy=True)
            st.vb[:, :, :old, :] = xp.asarray(st.vb[:, :, src:src + old, :], copy=True)
            st.off, st.n = 0, old
        end = st.off + st.n
        st.kb[:, :, end:end + t, :] = k
        st.vb[:, :, end:end + t, :] = v
        st.n += t
        if st.n > keep:
            st.off += st.n - keep
            st.n = keep

    def _as_input(self, st: WindowLayer, a: Any) -> Any:
        return a if a.dtype == st.dtype else st.xp.astype(a, st.dtype)

    def _store(self, st, k, v, q) -> None:
        ks, vs = self._stored(st, k, v)
        self._push(st, ks, vs)

    def _prefill(self, st, k, v, q) -> DequantResult:
        ks, vs = self._stored(st, k, v)
        xp = st.xp
        if st.n:
            hk, hv = st.held()
            rk, rv = xp.concat([hk, ks], axis=2), xp.concat([hv, vs], axis=2)
        else:
            rk, rv = xp.asarray(ks, copy=True), xp.asarray(vs, copy=True)
        self._push(st, ks, vs)
        return DequantResult(k=self._as_input(st, rk), v=self._as_input(st, rv))

    def _decode(self, st, k, v, q, config: AttendConfig):
        ks, vs = self._stored(st, k, v)
        self._push(st, ks, vs)
        hk, hv = st.held()
        w = min(st.n, self.window)
        return Dequantized(DequantResult(k=self._as_input(st, hk[:, :, st.n - w:, :]),
                                         v=self._as_input(st, hv[:, :, st.n - w:, :])))

    def _decoded(self, st, start: int = 0) -> DequantResult:
        hk, hv = st.held()
        return DequantResult(k=self._as_input(st, hk), v=self._as_input(st, hv))

    def _dequantize_from(self, st, start: int) -> DequantResult:
        first = st.length - st.n  # position of the oldest held row
        if start < first:
            raise ValueError(f"start must be at least {first}: a window layer holds positions {first} .. "
                             f"{st.length - 1} only, received {start}")
        r = self._decoded(st)
        return DequantResult(k=r.k[:, :, start - first:, :], v=r.v[:, :, start - first:, :])

    def held_tokens(self, layer: int) -> int:
        """Rows ``layer`` holds (the last positions of the sequence); 0 for an empty layer."""
        got = self._with_layer(layer, lambda st: st.n)
        return 0 if got is None else got

    def _stable_length(self, st) -> int:
        return 0  # the oldest held rows leave as tokens arrive: no row index stays put

    # -- bytes -------------------------------------------------------------------------
    def _side_nbytes(self, st) -> int:
        if st.kb is None:
            return 0
        row = _compat.array_nbytes(st.kb[:, :, :1, :]) + _compat.array_nbytes(st.vb[:, :, :1, :])
        return row * st.n

    def _side_spare_nbytes(self, st) -> int:
        if st.kb is None:
            return 0
        return _compat.array_nbytes(st.kb) + _compat.array_nbytes(st.vb) - self._side_nbytes(st)

    # -- truncate, snapshots -----------------------------------------------------------
    def _truncate_floor(self, st) -> int:
        first = st.length - st.n
        if first == 0:
            return 1  # every token is held
        # the next decode reads the last window - 1 rows; and a layer holding tokens keeps at least one row
        # (a window of 1 would otherwise reach a state of no rows, which restore and cache files refuse)
        return min(st.length, first + max(self.window - 1, 1))

    def _truncate_plan(self, st, length: int):
        drop = st.length - length

        def apply():
            st.n -= drop

        return apply

    def _layer_arrays(self, st) -> dict:
        if st.kb is None:
            return {}
        hk, hv = st.held()
        return {"k": hk, "v": hv}

    def _restore_layer(self, xp, dev, batch, dtype, length, arrays) -> WindowLayer:
        want = xp.float16 if self.storage == "float16" else dtype
        shape = None
        for name in ("k", "v"):
            a = arrays[name]
            if a.ndim != 4 or a.dtype != want:
                raise ValueError(f"stored array {name!r} must be 4-d of dtype {want}, received "
                                 f"{a.ndim}-d {a.dtype}")
            s = tuple(int(x) for x in a.shape)
            if s[0] != batch or s[1] != self.num_kv_heads or s[3] != self.head_dim:
                raise ValueError(f"stored array {name!r} has shape {s}; expected ({batch}, {self.num_kv_heads}, "
                                 f"rows, {self.head_dim})")
            if shape is not None and s != shape:
                raise ValueError(f"stored arrays 'k' and 'v' differ in shape: {shape} and {s}")
            shape = s
        n = shape[2]
        if n > min(length, self.keep) or n < min(length, self.window - 1) or (length and n == 0):
            raise ValueError(f"a window layer of {length} tokens holds between {min(length, self.window - 1)} and "
                             f"{min(length, self.keep)} rows, received {n}")
        st = WindowLayer(xp=xp, device=dev, batch=batch, dtype=dtype, length=length)
        self._push(st, arrays["k"], arrays["v"])
        return st

    def _extra_config(self) -> dict:
        return {"window": self.window, "rollback_tokens": self.rollback_tokens, "storage": self.storage}
