"""What the two ONNX Runtime decoders share: geometry, caches, token inputs and generation steps.

:class:`OrtEngine` is the base of :class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder`
and :class:`~arraykv.integrations.onnxruntime.graph_decoder.OrtGraphDecoder`: it makes caches of
the graph's geometry and gives :meth:`GenerationFront.generate
<arraykv.integrations.common.generation.GenerationFront.generate>` its decode step. The functions
read the geometry a graph declares and build the token inputs of a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._compat import to_numpy
from ..common.generation import GenerationFront

__all__ = ["OrtEngine", "declared_dim", "int_types", "token_feeds", "token_ids"]

#: The integer inputs of a token-id decoder besides its past, in the order they are fed.
TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids")


class OrtEngine(GenerationFront):
    """The part of an ONNX Runtime decoder that does not depend on how it holds the past.

    Its decoders' generation is :meth:`GenerationFront.generate
    <arraykv.integrations.common.generation.GenerationFront.generate>`, the one every engine
    shares, and their caches come from :meth:`make_cache`.

    A subclass sets :attr:`num_layers`, :attr:`num_kv_heads` and :attr:`head_dim` and defines
    ``decode(input_ids, cache)`` (logits (batch, 1, vocab)) and the prompt steps of
    :class:`~arraykv.integrations.common.generation.GenerationFront`.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim : int
        The geometry of the graph's KV cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def make_cache(self, method: str = "dense", **options: Any) -> Any:
        """A cache of this decoder's geometry (``arraykv.make_cache`` with layers/heads/head_dim filled).

        Parameters
        ----------
        method : str, default "dense"
            The cache method.
        **options
            The method's options.

        Returns
        -------
        LayeredCache
            An empty cache.
        """
        from ...caches import make_cache

        return make_cache(
            method, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, **options
        )

    def decode(self, input_ids: Any, cache: Any) -> Any:
        """One token per sequence after the prompt; logits (batch, 1, vocab) (each decoder defines it).

        Parameters
        ----------
        input_ids : int or array-like of int, shape (batch,) or (batch, 1)
            The tokens.
        cache : CompressedKVCache
            Holding the earlier tokens.

        Returns
        -------
        numpy.ndarray, shape (batch, 1, vocab)
            The logits.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no decode")

    def _cache_layers(self) -> int:
        return self.num_layers

    def _token_logits(self, token: int, cache: Any) -> Any:
        return to_numpy(self.decode([token], cache))[0, -1]


def declared_dim(declared: Any, given: int | None, name: str) -> int:
    """A dimension of the past inputs: the graph's when it declares one (``given`` must agree),
    else ``given``; a ValueError when neither says."""
    if isinstance(declared, int) and declared > 0:
        if given is not None and given != declared:
            raise ValueError(f"{name}={given} disagrees with the model's past_key_values shape ({declared})")
        return declared
    if given is None:
        raise ValueError(f"the model's past_key_values inputs have a symbolic {name} ({declared!r}); pass {name}=")
    return int(given)


def int_types(inputs: dict[str, Any]) -> dict[str, type[np.integer[Any]]]:
    """The integer type of each token input the session has (``inputs``: name to ``NodeArg``).

    A ValueError when it has no ``input_ids``: only token-id decoders are driven.
    """
    if "input_ids" not in inputs:
        raise ValueError("the ONNX model has no input_ids input; only token-id decoders are supported")
    return {
        name: (np.int32 if inputs[name].type == "tensor(int32)" else np.int64)
        for name in TOKEN_INPUTS
        if name in inputs
    }


def token_ids(input_ids: Any) -> np.ndarray[Any, Any]:
    """``input_ids`` as a NumPy integer array (batch, new_tokens), or a ValueError."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be integers of shape (batch, new_tokens), received {ids.shape} {ids.dtype}")
    return ids


def token_feeds(
    ids: np.ndarray[Any, Any], past_len: int, types: dict[str, type[np.integer[Any]]]
) -> dict[str, np.ndarray[Any, Any]]:
    """The token inputs of a step: ``ids`` (batch, t) after ``past_len`` tokens, with the
    attention mask and positions where the session (``types``, of :func:`int_types`) takes them."""
    batch, t = ids.shape
    feeds = {"input_ids": ids.astype(types["input_ids"])}
    if "attention_mask" in types:
        feeds["attention_mask"] = np.ones((batch, past_len + t), dtype=types["attention_mask"])
    if "position_ids" in types:
        pos = np.arange(past_len, past_len + t, dtype=types["position_ids"])
        feeds["position_ids"] = np.broadcast_to(pos, (batch, t)).copy()
    return feeds
