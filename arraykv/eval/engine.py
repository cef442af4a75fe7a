"""What the evaluations need from an engine, for :class:`~arraykv.integrations.decoder.model.DecoderModel` and
:class:`~arraykv.integrations.onnxruntime.OrtKVDecoder` alike.

An engine has ``make_cache(method, **options)``, ``prefill(ids, cache)`` and
``decode(token, cache)``; its geometry comes from ``config`` (a GGUF model) or from its own
``num_layers`` / ``num_kv_heads`` / ``head_dim`` attributes (an ONNX decoder), and its context
length from ``config.context_length`` when it has one.
"""

from __future__ import annotations

from typing import Any, Protocol

from .. import _compat
from .._types import Array
from ..protocol import Capability

__all__ = ["EvalEngine", "ENGINE", "geometry", "context_length", "decode_logits"]


class EvalEngine(Protocol):
    """What the evaluations call on an engine: a cache of its geometry, a prompt, a step.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`typing.Protocol`, which cannot be instantiated.
    """

    def make_cache(self, method: str, **options: Any) -> Any:
        """An empty cache of the engine's geometry (see ``DecoderModel.make_cache``).

        Parameters
        ----------
        method : str
        **options
            Options of the method.

        Returns
        -------
        CompressedKVCache
        """
        ...

    def prefill(self, token_ids: Any, cache: Any) -> Any:
        """Run a prompt after what ``cache`` holds; its logits.

        Parameters
        ----------
        token_ids : sequence of int
        cache : CompressedKVCache

        Returns
        -------
        array
        """
        ...

    def decode(self, token: int, cache: Any) -> Any:
        """One step on ``token``; its logits.

        Parameters
        ----------
        token : int
        cache : CompressedKVCache

        Returns
        -------
        array
        """
        ...


#: ``make_cache``, ``prefill``, ``decode``: :class:`EvalEngine`, asked with :func:`arraykv.protocol.supports`.
ENGINE = Capability[EvalEngine]("eval_engine", EvalEngine)


def geometry(engine: Any) -> dict:
    """``{"num_layers", "num_kv_heads", "head_dim"}`` of ``engine``, ints.

    Raises
    ------
    TypeError
        ``engine`` has neither a ``config`` nor those attributes.
    """
    src = getattr(engine, "config", engine)
    try:
        return {name: int(getattr(src, name)) for name in ("num_layers", "num_kv_heads", "head_dim")}
    except AttributeError:
        raise TypeError(
            f"model must be a DecoderModel or an OrtKVDecoder (num_layers, num_kv_heads, head_dim), "
            f"received {type(engine).__name__}"
        ) from None


def context_length(engine: Any) -> int | None:
    """The longest sequence ``engine`` declares, or None when it declares none (an ONNX decoder)."""
    limit = getattr(getattr(engine, "config", None), "context_length", None)
    return None if limit is None else int(limit)


def decode_logits(engine: Any, token: int, cache: Any) -> Array:
    """Logits after one decode step on ``token``, as NumPy of shape (vocab,).

    ``DecoderModel.decode`` answers ``(vocab,)`` for an int and ``OrtKVDecoder.decode``
    ``(1, 1, vocab)``; both become ``(vocab,)``.
    """
    return _compat.to_numpy(engine.decode(token, cache)).reshape(-1)
