"""The exact reference cache: keys and values kept as given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from .._types import Array, Device, DType, Namespace
from ..protocol import AttendConfig, Dequantized, DequantResult
from ..storage import TokenBuffers
from .base import LayeredCache, LayerState
from .layout import Layout, Spec

__all__ = ["DenseCache", "DenseLayer"]


@dataclass
class DenseLayer(LayerState):
    """One layer of a :class:`DenseCache`: ``buf`` holds arrays ``k`` and ``v`` (b, h, tokens, d)."""

    buf: TokenBuffers = None  # type: ignore[assignment]  # set by DenseCache._new_layer
    undo: ClassVar[str] = "fields"  # a token buffer, appended to (arraykv.caches.transaction)

    def buffers(self) -> tuple[TokenBuffers, ...]:
        return (self.buf,)


class DenseCache(LayeredCache[DenseLayer]):
    """Keys and values stored uncompressed in growable per-layer buffers.

    The reference implementation of the contract: ``prefill`` and ``decode`` return exactly
    the keys and values that were given, so attention over them equals attention without a
    cache. ``decode`` returns :class:`~arraykv.Dequantized`.

    The returned K/V are views of the cache's buffers: valid until the next call on the layer
    grows it or :meth:`reset`; copy them to keep them longer, and never write into them.

    Parameters
    ----------
    num_layers : int
        Transformer layers; valid layer indices are ``0 .. num_layers - 1``.
    num_kv_heads : int
        KV heads per layer.
    head_dim : int
        Channels per head.
    check_finite : bool, default True
        Reject keys and values that hold NaN or infinity (one pass over the new tokens).
    max_tokens : int or None, default None
        Tokens a layer may hold; a call that would exceed it raises ``ValueError``.
    """

    method = "dense"
    #: Tokens are held as given: a prompt needs no exact staging (:mod:`arraykv.integrations.common.prompt_stage`).
    stores_exactly = True

    def _new_layer(self, xp: Namespace, dev: Device, batch: int, dtype: DType) -> DenseLayer:
        return DenseLayer(xp=xp, device=dev, batch=batch, dtype=dtype, buf=TokenBuffers(max_tokens=self.max_tokens))

    def _append(self, st: DenseLayer, k: Array, v: Array) -> DequantResult:
        """Store ``k``, ``v``; return views of every stored token (what subclasses change to store otherwise)."""
        st.buf.append({"k": k, "v": v})
        st.stored = True
        return self._decoded(st)

    def _store(self, st: DenseLayer, k: Array, v: Array, q: Array) -> None:
        self._append(st, k, v)

    def _decoded(self, st: DenseLayer, start: int = 0) -> DequantResult:
        k, v = st.buf.view("k"), st.buf.view("v")
        if start:
            k, v = k[:, :, start:, :], v[:, :, start:, :]
        return DequantResult(k=k, v=v)

    def _prefill(self, st: DenseLayer, k: Array, v: Array, q: Array) -> DequantResult:
        return self._append(st, k, v)

    def _decode(self, st: DenseLayer, k: Array, v: Array, q: Array, config: AttendConfig) -> Dequantized:
        return Dequantized(self._append(st, k, v))

    def _stable_length(self, st: DenseLayer) -> int:
        return st.length  # stored as given

    def _truncate_floor(self, st: DenseLayer) -> int:
        return 0  # every length: the tokens are held as given

    def _truncate_plan(self, st: DenseLayer, length: int) -> Callable[[], None]:
        plan = st.buf.truncate_plan(length)
        return lambda: st.buf.commit_truncate(plan)

    def _layer_arrays(self, st: DenseLayer) -> dict[str, Array]:
        return st.buf.arrays()

    def _layer_layout(self, xp: Namespace, batch: int, dtype: DType, length: int) -> Layout:
        """``k`` and ``v``: (batch, kv_heads, length, head_dim) in the layer's dtype, finite."""
        shape = (batch, self.num_kv_heads, length, self.head_dim)
        return Layout(arrays={"k": Spec(dtype, shape), "v": Spec(dtype, shape)})

    def _restore_layer(
        self, xp: Namespace, dev: Device, batch: int, dtype: DType, length: int, arrays: dict[str, Array]
    ) -> DenseLayer:
        st = self._new_layer(xp, dev, batch, dtype)
        st.buf.append({"k": arrays["k"], "v": arrays["v"]})
        st.length = length
        return st
