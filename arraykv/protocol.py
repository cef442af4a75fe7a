"""The compressed KV-cache contract.

A Python rendering of the ``CompressedKVCache`` trait: five methods, two result types and one
attention configuration. Every cache in :mod:`arraykv.caches` satisfies it, and so can a third
party's cache registered with :func:`arraykv.register_method`.

Shapes
------
``k``, ``v``
    ``(batch, kv_heads, new_tokens, head_dim)``
``q``
    ``(batch, q_heads, new_tokens, head_dim)`` with ``q_heads = kv_heads * n_kv_groups``;
    query head ``h`` attends with KV head ``h // n_kv_groups``.
``DequantResult.k``, ``DequantResult.v``
    ``(batch, kv_heads, total_tokens, head_dim)``: every token stored so far in that layer.
``DequantResult.logit_bias``
    ``None`` or ``(batch, q_heads, new_tokens, total_tokens)``, added to the already scaled
    logits before the softmax.
``Fused.output``
    ``(batch, q_heads, 1, head_dim)``.

Arrays come back in the namespace, device and dtype of the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ._types import Array
from ._validation import check_int, check_softmax_scale

__all__ = [
    "AttendConfig",
    "DequantResult",
    "Fused",
    "Dequantized",
    "DecodeOutput",
    "CompressedKVCache",
]


@dataclass(frozen=True)
class AttendConfig:
    """How decode attention is computed.

    Parameters
    ----------
    softmax_scale : float
        Multiplies ``q · k`` before the softmax (usually ``1 / sqrt(head_dim)``).
    n_kv_groups : int, default 1
        Query heads per KV head (grouped-query attention); 1 is multi-head attention.
    """

    softmax_scale: float
    n_kv_groups: int = 1

    def __post_init__(self) -> None:
        # NumPy scalars are accepted and stored as Python float/int.
        object.__setattr__(self, "softmax_scale", check_softmax_scale(self.softmax_scale))
        object.__setattr__(self, "n_kv_groups", check_int("n_kv_groups", self.n_kv_groups, low=1))


@dataclass(frozen=True)
class DequantResult:
    """Keys and values of every stored token, ready for attention.

    Parameters
    ----------
    k, v : array, shape (batch, kv_heads, total_tokens, head_dim)
        Keys and values, in the dtype of the input.
    logit_bias : array or None, shape (batch, q_heads, new_tokens, total_tokens)
        Added to the scaled logits before the softmax (for example the QJL correction of
        TurboQuant-prod keys, already multiplied by the softmax scale).
    """

    k: Array
    v: Array
    logit_bias: Array | None = None


@dataclass(frozen=True)
class Fused:
    """Decode computed attention itself.

    Parameters
    ----------
    output : array, shape (batch, q_heads, 1, head_dim)
        The attention output of the new token, in the namespace, device and dtype of the input.
    """

    output: Array


@dataclass(frozen=True)
class Dequantized:
    """Decode returns keys and values; the caller runs attention.

    Parameters
    ----------
    result : DequantResult
        Keys and values of every stored token of the layer, the new one included.
    """

    result: DequantResult


DecodeOutput = Fused | Dequantized


@runtime_checkable
class CompressedKVCache(Protocol):
    """A per-layer KV cache that stores keys and values in compressed form.

    Every method is safe to call from several threads: calls on different layers run in
    parallel, calls on the same layer are serialized.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated (``TypeError``): a
        cache satisfies the protocol by defining its methods, not by subclassing or calling it.
    """

    def prefill(self, layer: int, k: Array, v: Array, q: Array) -> DequantResult:
        """Store ``new_tokens`` keys/values and return K/V of all tokens stored in ``layer``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, new_tokens, head_dim)
            Keys (after RoPE) and values of the new tokens.
        q : array, shape (batch, q_heads, new_tokens, head_dim)
            Queries of the new tokens (a cache may use them, for example to weight key channels).

        Returns
        -------
        DequantResult
            Keys and values of every token stored in ``layer``, the new ones included.
        """
        ...

    def decode(self, layer: int, k: Array, v: Array, q: Array, config: AttendConfig) -> DecodeOutput:
        """Store exactly one new token and return attention (``Fused``) or K/V (``Dequantized``).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k, v : array, shape (batch, kv_heads, 1, head_dim)
            Key (after RoPE) and value of the new token.
        q : array, shape (batch, q_heads, 1, head_dim)
            Query of the new token.
        config : AttendConfig
            Softmax scale and grouped-query layout, for a cache that computes attention itself.

        Returns
        -------
        Fused or Dequantized
            The attention output of the new token, or the keys and values of every stored token
            for the caller to attend over.
        """
        ...

    def seq_len(self, layer: int) -> int:
        """Tokens stored in ``layer``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            Tokens given to ``layer`` so far (0 when empty).
        """
        ...

    def reset(self) -> None:
        """Forget every stored token of every layer."""
        ...

    def memory_usage(self) -> int:
        """Bytes of compressed state actually held, over all layers.

        Returns
        -------
        int
            Bytes of the stored tokens' compressed form, over every layer.
        """
        ...
