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
(:func:`arraykv.integrations.decoder.attention.window_mask`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import _compat, ops
from .._types import Array, Device, DType, Namespace
from .._validation import check_int, dtype_name
from ..protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult, Fused, WindowTailKVCache
from ..quant.bitpack import packed_nbytes
from ..quant.polar import half_dtype
from .base import LayeredCache, LayerState, check_decode_path, refuse_overflow
from .layout import Layout, Spec, join
from .polar_calibration import PolarCalibration, calibrate, calibration_layout
from .polar_codec import PolarFixed, PolarLayerCodec
from .polar_decode import decode_tokens
from .polar_options import check_polar_options
from .restore_checks import check_encoded_storage_room
from .rollback import DEFAULT_ROLLBACK_TOKENS, check_rollback_tokens
from .sliding import copied

__all__ = ["SlidingWindowCache", "WindowLayer", "WINDOW_STORAGE", "POLAR_STORAGE", "OUTLIER_OPTIONS"]

#: How a window layer holds its tokens: float16 (half the bytes of float32, range ±65504),
#: exactly as given, or compressed per token by the calibrated codec of the ``pqo`` caches at
#: 2 to 8 bits (:data:`POLAR_STORAGE`).
WINDOW_STORAGE = ("float16", "exact", "pq2", "pq3", "pq4", "pq5", "pq6", "pq8")

#: The compressed storages and their bits per coordinate.
POLAR_STORAGE = {"pq2": 2, "pq3": 3, "pq4": 4, "pq5": 5, "pq6": 6, "pq8": 8}
#: Options of the ``pq`` storages' exact outlier key channels (those of the ``pqo`` caches).
OUTLIER_OPTIONS = ("outliers", "outlier_threshold", "max_outliers")
#: Most recent tokens a compressed window also holds in float16 by default (measured on
#: Gemma-3-270M, docs/algorithms.md §11: the last 8 buy what 64 buy, halving pqo4's KL).
DEFAULT_EXACT_TAIL = 8


@dataclass
class WindowLayer(LayerState):
    """One layer of a :class:`SlidingWindowCache`.

    Attributes
    ----------
    rows : dict of str to array
        Buffers by saved name, each ``(batch, kv_heads, capacity, ...)``: ``k``, ``v`` (float16
        or exact storage, ``(..., head_dim)``), or ``k_codes``, ``v_codes`` (uint8, ``(...,
        ceil(head_dim * bits / 8))``) and ``k_norms``, ``v_norms`` (float16, ``(...)``) for the
        ``pq`` storages (and ``k_outliers``, float16 ``(..., n_out)``, where the calibration
        keeps outlier channels). Rows ``off .. off + n`` are the held tokens, oldest first.
    off, n : int
        First held row and the number of rows held (the last ``n`` positions, ``n <= length``).
    tail_k, tail_v : array of float16, shape (batch, kv_heads, T, head_dim), or None
        ``pq`` storages: the last ``T`` positions again, in float16 (``T = min(n, exact_tail +
        rollback_tokens)``, fewer after a truncation).
    calib : PolarCalibration or None
        ``pq`` storages: the layer's calibration, made by its first call (``fixed_end`` is
        that call's end).
    """

    rows: dict = field(default_factory=dict)
    off: int = 0
    n: int = 0
    tail_k: Array = None
    tail_v: Array = None
    calib: PolarCalibration | None = None

    #: The buffers of ``rows`` are written in place (:meth:`mark_rows`); every other field is
    #: replaced by a store (:mod:`arraykv.caches.transaction`).
    undo: ClassVar[str] = "fields"

    def held(self) -> dict[str, Array]:
        """Views of the held rows by name, each ``(batch, kv_heads, n, ...)``."""
        return {name: b[:, :, self.off : self.off + self.n, ...] for name, b in self.rows.items()}

    def mark_rows(self) -> dict[str, Array]:
        """Copies of the held rows (a store moves and overwrites rows of the buffers in place)."""
        return {name: copied(a) for name, a in self.held().items()}

    def rewind_rows(self, mark: dict[str, Array]) -> None:
        """The held rows of :meth:`mark_rows` written back into ``rows`` at ``off`` (the fields
        ``rows``, ``off`` and ``n`` restored first): the same buffers and places as before."""
        for name, a in mark.items():
            self.rows[name][:, :, self.off : self.off + self.n, ...] = a

    def tail_rows(self) -> int:
        """Rows of the float16 tail (the last positions, ``pq`` storages); 0 without one."""
        return 0 if self.tail_k is None else int(self.tail_k.shape[2])


class SlidingWindowCache(LayeredCache[WindowLayer], WindowTailKVCache):
    """Keys and values of the last ``window + rollback_tokens`` tokens of each layer.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry: layers, KV heads per layer and channels per head.
    window : int
        The attention span: a token sees itself and the ``window - 1`` tokens before it.
    rollback_tokens : int, default 16
        Extra tokens held so that :meth:`truncate` can take that many back.
    storage : {"float16", "exact", "pq2", "pq3", "pq4", "pq5", "pq6", "pq8"}, default "float16"
        ``"float16"`` holds half the bytes of float32 (a value beyond ±65504 is refused, as
        in every float16 part of the compressed caches); ``"exact"`` holds the input dtype;
        ``"pqB"`` holds every key and value in the ``B``-bit codec of the ``pqoB`` caches
        (calibrated centering, query-weighted key channels and exact outlier channels, then a
        random rotation and Lloyd-Max codes; ``B + 16 / head_dim`` bits per value plus the
        outlier channels), and its last ``exact_tail`` tokens in float16 as well.
    exact_tail : int, optional
        ``pq`` storages: most recent tokens also held in float16, which the layer attends
        exactly (default :data:`DEFAULT_EXACT_TAIL`); ``rollback_tokens`` more are held for
        truncation.
    seed : int, default 0
        Seed of the ``pq`` storages' rotation.
    decode_path : {"auto", "fused", "dequantized"}, default "auto"
        ``pq`` storages: ``decode`` attends from the codes itself (:class:`~arraykv.Fused`,
        the ``pqo`` fused kernel over the last ``window`` rows) where a kernel serves the
        namespace (``"auto"``), or returns the window's keys and values. Float storages always
        return them.
    outliers : {"auto"} or int, default "auto"
        ``pq`` storages: the exact outlier key channels, as for the ``pqo`` caches
        (:class:`~arraykv.caches.polar.PolarCache`).
    outlier_threshold : float, optional
        ``pq`` storages: the threshold of ``outliers="auto"`` (default: the ``pqo`` caches').
    max_outliers : int, optional
        ``pq`` storages: the cap of ``outliers="auto"`` (default: the ``pqo`` caches').
    check_finite : bool, default True
        Reject keys and values that hold NaN or infinity, as every cache does.
    max_tokens : int, optional
        Tokens a layer may be given, counted as positions (not the rows the window keeps); a
        call that would exceed it raises ``ValueError``.

    Notes
    -----
    ``prefill`` returns the tokens held before the call and the new ones, ``(batch, kv_heads,
    n, head_dim)`` for the last ``n`` positions: the held ones as stored (float16-rounded, or
    decoded from their codes), the new ones as stored for the float storages and as given for
    the ``pq`` ones (a call attends its own tokens exactly, as the compressed global layers
    do); a causal chunk of queries masks them by the window. ``decode`` returns exactly the
    last ``window`` tokens (fewer at the start), so attention over them needs no mask.
    Truncating is exact for attention: a layer truncated to ``L`` attends as the direct build
    of ``L`` tokens by the same calls does, but holds fewer rows of the past (the rows a direct
    build would hold in its rollback margin are gone), so its saved arrays are shorter.
    Lengths from ``seq_len - rollback_tokens`` (and 0) are reachable, and for the ``pq``
    storages none inside the layer's first call.

    The ``pq`` storages calibrate a layer once, on the keys, values and queries of its first
    call (for a prompt, the rows the window keeps of it), exactly as a ``pqo`` layer does
    (:func:`arraykv.caches.polar_calibration.calibrate`), and encode every token by itself
    with that calibration (TurboQuant-MSE after centering and channel weights:
    :func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference`), so the oldest rows
    leave and truncation drops the newest without touching any other row. A layer whose
    first call holds fewer than 8 tokens gets no centering or channel weights (the plain
    codec): feed a prompt first.
    """

    method = "window"

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
        storage: str = "float16",
        exact_tail: int | None = None,
        seed: int = 0,
        decode_path: str = "auto",
        outliers: Any = "auto",
        outlier_threshold: float | None = None,
        max_outliers: int | None = None,
        check_finite: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            check_finite=check_finite,
            max_tokens=max_tokens,
        )
        self.window = check_int("window", window, low=1)
        self.rollback_tokens = check_rollback_tokens(rollback_tokens)
        if not isinstance(storage, str) or storage not in WINDOW_STORAGE:
            raise ValueError(f"storage must be one of {', '.join(WINDOW_STORAGE)}, received {storage!r}")
        self.storage = storage
        self.seed = check_int("seed", seed, low=0)
        self.decode_path = check_decode_path(decode_path)
        #: Bits per coordinate of the ``pq`` storages (None: float storage).
        self.bits = POLAR_STORAGE.get(storage)
        if self.bits is None:
            given = {
                "exact_tail": exact_tail,
                "outlier_threshold": outlier_threshold,
                "max_outliers": max_outliers,
                "outliers": None if isinstance(outliers, str) and outliers == "auto" else outliers,
            }
            for name, value in given.items():
                if value is not None:
                    raise ValueError(
                        f"{name} applies to the pq storages; storage {storage!r} holds every token "
                        f"as {'given' if storage == 'exact' else 'float16'}"
                    )
            self.exact_tail = 0
            self.options = None
        else:
            self.exact_tail = check_int("exact_tail", DEFAULT_EXACT_TAIL if exact_tail is None else exact_tail, low=0)
            #: The codec's options: those of ``pqoB`` (checks head_dim too).
            outlier_opts = {"outliers": outliers, "max_outliers": max_outliers}
            if outlier_threshold is not None:
                outlier_opts["outlier_threshold"] = outlier_threshold
            self.options = check_polar_options(
                self.head_dim, key_bits=self.bits, value_bits=self.bits, seed=seed, **outlier_opts
            )
        #: Rows a layer keeps after every call.
        self.keep = self.window + self.rollback_tokens
        #: Float16 tail rows a ``pq`` layer keeps (the exact tail and the rollback margin).
        self.tail_keep = 0 if self.bits is None else self.exact_tail + self.rollback_tokens
        #: Spare rows of a layer's buffers at most: ``max(16, keep // 16)``, so the held rows move
        #: back to the buffers' start once every that many decode steps (a copy of ``keep`` rows:
        #: at most 16 rows per step, a few percent of the ``window`` rows a decode step reads).
        self.spare = max(16, self.keep // 16)
        #: Rows of a layer's buffers at most: ``keep + spare``. The buffers start at a prompt's rows
        #: exactly and grow by doubling while small, by ``spare`` rows at most, up to it.
        self.capacity = self.keep + self.spare
        self._fixed: dict = {}

    @property
    def stores_exactly(self) -> bool:  # type: ignore[override]  # a class attribute of the base
        """Whether tokens are held as given (or float16): a prompt then needs no exact staging."""
        return self.bits is None

    # -- the pq codec ------------------------------------------------------------------
    def _codec(self, xp: Namespace, dev: Device) -> PolarFixed:
        """Rotation and codebooks of the ``pq`` storage on ``xp``/``dev`` (built once)."""
        key = (id(xp), str(dev))
        got: PolarFixed | None = self._fixed.get(key)
        if got is None:
            assert self.bits is not None  # only the pq storages have a codec
            got = PolarFixed.build(
                xp, dev, head_dim=self.head_dim, key_bits=self.bits, value_bits=self.bits, seed=self.seed, qjl=False
            )
            self._fixed[key] = got
        return got

    def _fixed_nbytes(self) -> int:
        return sum(c.nbytes() for c in list(self._fixed.values()))

    def _fused_auto(self, xp: Namespace) -> bool:
        return ops.has_kernel("polar_decode_attention", xp)

    def _fused(self, xp: Namespace) -> bool:
        return self.bits is not None and super()._fused(xp)  # float rows are returned as they are

    def _on_reset(self) -> None:
        self._fixed = {}

    def row_shapes(self, n_outliers: int = 0) -> dict:
        """The held rows' arrays by saved name: their shapes after ``(batch, kv_heads, rows)``.

        Parameters
        ----------
        n_outliers : int, default 0
            Exact outlier key channels per head (``pq`` storages); with some, a
            ``k_outliers`` array is listed.

        Returns
        -------
        dict of str to tuple of int
            ``k`` and ``v`` for the float storages; ``k_codes``, ``k_norms``, ``v_codes``,
            ``v_norms`` (and ``k_outliers``) for the ``pq`` ones.
        """
        if self.bits is None:
            return {"k": (self.head_dim,), "v": (self.head_dim,)}
        nb = packed_nbytes(self.head_dim, self.bits)
        out = {"k_codes": (nb,), "k_norms": (), "v_codes": (nb,), "v_norms": ()}
        if n_outliers:
            out["k_outliers"] = (n_outliers,)
        return out

    def _row_dtypes(self, xp: Namespace, dtype: DType) -> dict:
        if self.bits is None:
            d = xp.float16 if self.storage == "float16" else dtype
            return {"k": d, "v": d}
        h = half_dtype(xp)
        return {"k_codes": xp.uint8, "k_norms": h, "v_codes": xp.uint8, "v_norms": h, "k_outliers": h}

    # -- storing -----------------------------------------------------------------------
    def _new_layer(self, xp: Namespace, dev: Device, batch: int, dtype: DType) -> WindowLayer:
        return WindowLayer(xp=xp, device=dev, batch=batch, dtype=dtype)

    def _encode(self, st: WindowLayer, k: Array, v: Array, q: Array, start: int) -> tuple:
        """``(rows, calib, tail)`` of new tokens at positions ``start ..``: the rows in the
        storage form by name, the calibration this call makes (None when the layer has one,
        or for float storage) and the float16 rows for the tail (None without one). Nothing
        changes; a float16 overflow is refused here."""
        xp = st.xp
        if self.storage == "exact":
            return {"k": k, "v": v}, None, None
        if self.bits is None:
            out = {"k": xp.astype(k, xp.float16), "v": xp.astype(v, xp.float16)}
            refuse_overflow(xp, self.method, out)
            return out, None, None
        fixed = self._codec(xp, st.device)
        opts = self.options
        assert opts is not None  # set with bits
        kf, vf = xp.astype(k, xp.float32), xp.astype(v, xp.float32)
        new = None
        if st.calib is None:
            new = calibrate(opts, xp, kf, vf, xp.astype(q, xp.float32), start)
        c = st.calib if new is None else new
        assert c is not None  # made above when the layer had none
        enc = fixed.encoder(c, key_length=opts.key_length, value_length=opts.value_length, qjl=False)
        out = ops.polar_encode_tokens(kf, vf, enc, start)
        t = int(k.shape[2])
        m = min(t, self.tail_keep)
        tail = (xp.astype(k[:, :, t - m :, :], xp.float16), xp.astype(v[:, :, t - m :, :], xp.float16)) if m else None
        refuse_overflow(
            xp,
            self.method,
            {**out, "tail": [] if tail is None else list(tail), **({} if new is None else new.arrays())},
        )
        return out, new, tail

    def _apply(
        self, st: WindowLayer, rows: dict, calib: PolarCalibration | None, tail: tuple[Array, Array] | None, end: int
    ) -> None:
        """Commit what :meth:`_encode` computed; ``end`` is the length after the call."""
        if calib is not None:
            st.calib, st.fixed_end = calib, end
        self._push(st, rows)
        if tail is not None:
            xp = st.xp
            tk, tv = tail
            if st.tail_k is not None and int(tk.shape[2]) < self.tail_keep:
                tk, tv = xp.concat([st.tail_k, tk], axis=2), xp.concat([st.tail_v, tv], axis=2)
            cut = max(0, int(tk.shape[2]) - min(self.tail_keep, st.n))  # never more rows than held
            st.tail_k = xp.asarray(tk[:, :, cut:, :], copy=True)
            st.tail_v = xp.asarray(tv[:, :, cut:, :], copy=True)

    def _decode_rows(self, st: WindowLayer, rows: dict, first: int, end: int) -> tuple:
        """Keys and values, ``(batch, kv_heads, n, head_dim)`` in the layer's dtype, of stored
        ``rows`` at positions ``first ..``; ``end`` is the position after the layer's last held row."""
        xp = st.xp
        if self.bits is None:
            k, v = rows["k"], rows["v"]
        else:
            assert st.calib is not None  # pq rows are stored with the calibration they were made with
            k, v = decode_tokens(rows, st.calib, self._codec(xp, st.device), self.bits, self.bits, first)
            n = int(k.shape[2])
            exact = min(st.tail_rows(), self.exact_tail)
            lo = max(first, end - exact)  # positions lo .. first + n - 1 are in the exact tail
            if lo < first + n:
                t0 = st.tail_rows() - (end - lo)
                m = first + n - lo
                k[:, :, n - m :, :] = st.tail_k[:, :, t0 : t0 + m, :]
                v[:, :, n - m :, :] = st.tail_v[:, :, t0 : t0 + m, :]
        return (
            k if k.dtype == st.dtype else xp.astype(k, st.dtype),
            v if v.dtype == st.dtype else xp.astype(v, st.dtype),
        )

    def _push(self, st: WindowLayer, rows: dict) -> None:
        """Append stored rows and drop the oldest beyond ``keep``: amortized O(rows) per call."""
        xp, keep = st.xp, self.keep
        t = int(next(iter(rows.values())).shape[2])
        cap = int(next(iter(st.rows.values())).shape[2]) if st.rows else 0
        if t >= keep or not st.rows or (st.off + st.n + t > cap and cap < self.capacity):
            # a new buffer: the first rows, a chunk longer than what is kept, or growth towards the
            # capacity (doubling while small, then ``spare`` rows more: the spare room stays bounded);
            # a prompt's rows (several, none held before them) get a buffer of exactly their size
            old = 0 if not st.rows else min(st.n, keep - min(t, keep))
            m = min(t, keep)
            if old == 0 and t > 1:
                cap = m
            else:
                cap = min(self.capacity, max(64, old + m + min(old + m, self.spare)))
            held = st.held()
            bufs = {}
            for name, a in rows.items():
                b = xp.empty(
                    (st.batch, self.num_kv_heads, cap) + tuple(int(x) for x in a.shape[3:]),
                    dtype=a.dtype,
                    device=st.device,
                )
                if old:
                    b[:, :, :old, ...] = held[name][:, :, st.n - old :, ...]
                b[:, :, old : old + m, ...] = a[:, :, t - m :, ...]
                bufs[name] = b
            st.rows, st.off, st.n = bufs, 0, old + m
            return
        if st.off + st.n + t > cap:  # full capacity: move the rows that survive to the buffer's start
            old = min(st.n, keep - t)
            src = st.off + st.n - old
            for b in st.rows.values():
                b[:, :, :old, ...] = xp.asarray(b[:, :, src : src + old, ...], copy=True)
            st.off, st.n = 0, old
        end = st.off + st.n
        for name, b in st.rows.items():
            b[:, :, end : end + t, ...] = rows[name]
        st.n += t
        if st.n > keep:
            st.off += st.n - keep
            st.n = keep

    def _store_at(self, st: WindowLayer, k: Array, v: Array, q: Array, start: int, end: int) -> None:
        rows, calib, tail = self._encode(st, k, v, q, start)
        self._apply(st, rows, calib, tail, end)

    def _store(self, st: WindowLayer, k: Array, v: Array, q: Array) -> None:
        self._store_at(st, k, v, q, st.length, st.length + int(k.shape[2]))

    def _prefill(self, st: WindowLayer, k: Array, v: Array, q: Array) -> DequantResult:
        xp, start, t = st.xp, st.length, int(k.shape[2])
        rows, calib, tail = self._encode(st, k, v, q, start)
        # the new rows as stored (float storage), or as given (pq: a call's own tokens are
        # attended exactly, as the compressed global layers attend theirs)
        nk, nv = (k, v) if self.bits is not None else self._decode_rows(st, rows, start, start + t)
        if st.n:
            hk, hv = self._decode_rows(st, st.held(), start - st.n, start)
            rk, rv = xp.concat([hk, nk], axis=2), xp.concat([hv, nv], axis=2)
        else:
            rk = nk if nk is not k else xp.asarray(nk, copy=True)
            rv = nv if nv is not v else xp.asarray(nv, copy=True)
        self._apply(st, rows, calib, tail, start + t)
        return DequantResult(k=rk, v=rv)

    def _decode(self, st: WindowLayer, k: Array, v: Array, q: Array, config: AttendConfig) -> DecodeOutput:
        end = st.length + int(k.shape[2])
        self._store_tokens(st, k, v, q)
        w = min(st.n, self.window)
        if self._fused(st.xp):
            return Fused(ops.polar_decode_attention(self._window_codec(st, w, end), q, config.softmax_scale))
        last = {name: a[:, :, st.n - w :, ...] for name, a in st.held().items()}
        rk, rv = self._decode_rows(st, last, end - w, end)
        return Dequantized(DequantResult(k=rk, v=rv))

    def _window_codec(self, st: WindowLayer, w: int, end: int) -> PolarLayerCodec:
        """The last ``w`` held rows of a ``pq`` layer as the fused kernel reads a ``pqo`` layer.

        No sinks; the rows before the exact tail are the quantized tokens, the tail's last
        ``exact_tail`` rows (at most) the exact window. The kernel places quantized token ``j``
        at position ``j``: a key mean that turns with the position is given turned to the
        first row's position ``end - w``, which moves every row's mean to its own position.
        """
        xp = st.xp
        e = min(st.tail_rows(), self.exact_tail, w)
        t0 = st.tail_rows() - e
        rows = {name: a[:, :, st.n - w : st.n - e, ...] for name, a in st.held().items()}
        calib = st.calib
        assert calib is not None  # a pq layer holding rows is calibrated
        k_mean = calib.k_mean
        if calib.k_mean_freq is not None:
            k_mean = xp.astype(calib.key_mean(xp, end - w, 1)[:, :, 0, :], half_dtype(xp))
        fixed = self._codec(xp, st.device)
        has_out = calib.n_outliers > 0
        return PolarLayerCodec(
            n_sink=0,
            n_quantized=w - e,
            n_window=e,
            rotation=fixed.rotation,
            k_codebook=fixed.k_codebook,
            v_codebook=fixed.v_codebook,
            k_codes=rows["k_codes"],
            k_norms=rows["k_norms"],
            v_codes=rows["v_codes"],
            v_norms=rows["v_norms"],
            k_mean=k_mean,
            v_mean=calib.v_mean,
            k_scale=calib.k_scale,
            k_mean_freq=calib.k_mean_freq,
            k_mean_pairs=calib.k_mean_pairs,
            k_outlier_idx=calib.k_outlier_idx if has_out else None,
            k_outliers=rows["k_outliers"] if has_out else None,
            k_window=st.tail_k[:, :, t0:, :],
            v_window=st.tail_v[:, :, t0:, :],
            qjl=None,
            k_qjl=None,
            k_qjl_norms=None,
        )

    def _decoded(self, st: WindowLayer, start: int = 0) -> DequantResult:
        rk, rv = self._decode_rows(st, st.held(), st.length - st.n, st.length)
        return DequantResult(k=rk, v=rv)

    def _dequantize_from(self, st: WindowLayer, start: int) -> DequantResult:
        first = st.length - st.n  # position of the oldest held row
        if start < first:
            raise ValueError(
                f"start must be at least {first}: a window layer holds positions {first} .. "
                f"{st.length - 1} only, received {start}"
            )
        rows = {name: a[:, :, start - first :, ...] for name, a in st.held().items()}
        rk, rv = self._decode_rows(st, rows, start, st.length)
        return DequantResult(k=rk, v=rv)

    def append_last(self, layer: int, k: Array, v: Array, q: Array, tokens: int) -> None:
        """Store ``tokens`` new tokens of which only the last ones are given.

        For a caller that computed a long prompt itself and kept only what this layer will
        hold (:class:`arraykv.integrations.common.prompt_stage.PromptStage`): ``k``, ``v`` (and ``q``)
        are the last ``min(tokens, window + rollback_tokens)`` tokens or more; the layer's
        ``seq_len`` grows by ``tokens``. The same checks and errors as :meth:`append`.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, given, head_dim)
            Keys (after RoPE) and values of the last ``given`` of the new tokens,
            ``min(tokens, window + rollback_tokens) <= given <= tokens``.
        q : array, shape (batch, q_heads, given, head_dim)
            Queries of the same tokens.
        tokens : int
            New tokens in all, given or not.
        """
        layer = self._check_layer(layer)
        xp, shape = self._check_inputs(k, v, q)
        t = int(shape[2])
        tokens = check_int("tokens", tokens, low=t)
        if t < min(tokens, self.keep):
            raise ValueError(f"k must hold the last {min(tokens, self.keep)} of the {tokens} tokens, received {t}")
        with self._locks[layer]:
            st = self._admit(layer, xp, k, v, tokens)
            with self._taking_back(layer, st, tokens):
                self._store_at(st, k, v, q, st.length + tokens - t, st.length + tokens)

    def held_tokens(self, layer: int) -> int:
        """Rows ``layer`` holds (the last positions of the sequence); 0 for an empty layer.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            The rows held, at most ``window + rollback_tokens`` after a call.
        """
        got: int | None = self._with_layer(layer, lambda st: st.n)
        return 0 if got is None else got

    def _stable_length(self, st: WindowLayer) -> int:
        return 0  # the oldest held rows leave as tokens arrive: no row index stays put

    # -- bytes -------------------------------------------------------------------------
    def _tail_nbytes(self, st: WindowLayer, rows: int) -> int:
        return 0 if st.tail_k is None else rows * 2 * _compat.array_nbytes(st.tail_k[:, :, :1, :])

    def _side_nbytes(self, st: WindowLayer) -> int:
        rows = sum(_compat.array_nbytes(b[:, :, :1, ...]) for b in st.rows.values()) * st.n
        calib = 0 if st.calib is None else st.calib.nbytes()
        return rows + self._tail_nbytes(st, st.tail_rows()) + calib + self._rollback_record(st)

    def _side_spare_nbytes(self, st: WindowLayer) -> int:
        rows = sum(_compat.array_nbytes(b[:, :, :1, ...]) for b in st.rows.values())
        return sum(_compat.array_nbytes(b) for b in st.rows.values()) - rows * st.n

    def _rollback_record(self, st: WindowLayer) -> int:
        return 0 if st.calib is None else 8  # fixed_end, saved as one int64

    def _rollback_nbytes(self, st: WindowLayer) -> int:
        """The tail rows beyond ``exact_tail`` (held for truncation) and the calibrating call's record."""
        extra = max(0, st.tail_rows() - self.exact_tail)
        return self._tail_nbytes(st, extra) + self._rollback_record(st)

    # -- truncate, snapshots -----------------------------------------------------------
    def _truncate_floor(self, st: WindowLayer) -> int:
        first = st.length - st.n
        if first == 0:
            floor = 1  # every token is held
        else:
            # the next decode reads the last window - 1 rows; and a layer holding tokens keeps at least one
            # row (a window of 1 would otherwise reach a state of no rows, which restore and files refuse)
            floor = min(st.length, first + max(self.window - 1, 1))
        if st.calib is not None:
            floor = max(floor, st.fixed_end)  # a direct build would calibrate on other tokens
            tail = st.tail_rows()
            if tail < st.n:  # the exact tail must still cover the last exact_tail rows
                floor = max(floor, st.length - (tail - self.exact_tail))
        return floor

    def _truncate_plan(self, st: WindowLayer, length: int) -> Callable[[], None]:
        drop = st.length - length

        def apply() -> None:
            st.n -= drop
            if st.tail_k is not None:
                keep = st.tail_rows() - min(drop, st.tail_rows())
                st.tail_k, st.tail_v = st.tail_k[:, :, :keep, :], st.tail_v[:, :, :keep, :]

        return apply

    def _layer_arrays(self, st: WindowLayer) -> dict[str, Array]:
        if not st.rows:
            return {}
        out = st.held()
        if self.bits is not None:
            assert st.calib is not None  # a pq layer holding rows is calibrated
            out["k_tail"], out["v_tail"] = st.tail_k, st.tail_v
            out.update(st.calib.arrays())
            out["fixed_end"] = st.xp.asarray([st.fixed_end], dtype=st.xp.int64, device=st.device)
        return out

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout:
        """The saved arrays of a layer: its held rows (:meth:`row_shapes`, at least
        ``min(length, window - 1)`` and at most ``min(length, keep)``, one at least), and for the
        ``pq`` storages the calibration (:func:`~arraykv.caches.polar_calibration.calibration_layout`,
        required), the outlier channels' exact values exactly when it keeps some, the float16
        tail (between ``min(rows, exact_tail)`` and ``min(rows, exact_tail + rollback_tokens)``
        rows) and ``fixed_end`` in ``[1, length]``."""
        b, h = batch, self.num_kv_heads
        dtypes = self._row_dtypes(xp, dtype)
        arrays = {name: Spec(dtypes[name], (b, h, "rows") + tail) for name, tail in self.row_shapes().items()}

        def rows(sizes: dict, held: frozenset) -> str | None:
            n, lo, hi = sizes["rows"], min(length, self.window - 1), min(length, self.keep)
            if lo <= n <= hi and n:
                return None
            return f"a window layer of {length} tokens holds between {max(lo, 1)} and {hi} rows, received {n}"

        if self.bits is None:
            return Layout(arrays=arrays, rules=(rows,))
        half, d = half_dtype(xp), self.head_dim
        arrays.update(
            k_outliers=Spec(half, (b, h, "rows", "n_out"), required=False),
            k_tail=Spec(half, (b, h, "tail", d)),
            v_tail=Spec(half, (b, h, "tail", d)),
            fixed_end=Spec(xp.int64, (1,), low=1, high="length"),
        )

        def codec(sizes: dict, held: frozenset) -> str | None:
            if "k_mean" not in held:
                return "a pq window layer holds its calibration; 'k_mean' and the rest are missing"
            if ("k_outliers" in held) != (sizes.get("n_out", 0) > 0):
                return "stored 'k_outliers' must come exactly when the calibration keeps outlier channels"
            n, t = sizes["rows"], sizes["tail"]
            if min(n, self.exact_tail) <= t <= min(n, self.tail_keep):
                return None
            return (
                f"a window layer of {n} rows holds between {min(n, self.exact_tail)} and "
                f"{min(n, self.tail_keep)} tail rows, received {t}"
            )

        return join(
            calibration_layout(xp, b, h, d), Layout(arrays=arrays), sizes={"length": length}, rules=(rows, codec)
        )

    def _restore_layer(
        self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
    ) -> WindowLayer:
        st = WindowLayer(xp=xp, device=dev, batch=batch, dtype=dtype, length=length)
        if self.bits is not None:
            st.calib = PolarCalibration.from_arrays(xp, arrays)
            st.fixed_end = int(arrays["fixed_end"][0])
            st.tail_k = xp.asarray(arrays["k_tail"], copy=True)
            st.tail_v = xp.asarray(arrays["v_tail"], copy=True)
            fixed, half = self._codec(xp, dev), dtype_name(dtype)
            check_encoded_storage_room(xp, head_dim=self.head_dim, calib=st.calib, fixed=fixed, dtype=half)
        self._push(st, {name: arrays[name] for name in self.row_shapes(0 if st.calib is None else st.calib.n_outliers)})
        return st

    def _extra_config(self) -> dict:
        out = {
            "window": self.window,
            "rollback_tokens": self.rollback_tokens,
            "storage": self.storage,
            "seed": self.seed,
        }
        if self.options is not None:  # the pq storages (bits set)
            out["exact_tail"] = self.exact_tail
            out["decode_path"] = self.decode_path
            out["outliers"] = self.options.outliers
            out["outlier_threshold"] = self.options.outlier_threshold
            out["max_outliers"] = self.options.max_outliers
        return out
