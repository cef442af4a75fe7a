"""The public-domain texts shipped for evaluation, as token ids.

:func:`builtin_text` is *Pride and Prejudice*, chapters 1-2, about
2,260 SmolLM2 tokens; :func:`builtin_long_text` is chapters 1-6 (the same two chapters first),
about 10,050 tokens: enough for a 7,936-token prefix followed by 256 scored positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["builtin_text", "builtin_token_ids", "builtin_long_text", "builtin_long_token_ids", "text_token_ids"]


def builtin_text() -> str:
    """The public-domain text shipped for evaluation (Pride and Prejudice, chapters 1-2)."""
    from ..data import read_text

    return read_text()


def builtin_token_ids(tokenizer: Any, n_tokens: int = 512) -> list:
    """The first ``n_tokens`` token ids of :func:`builtin_text`.

    Parameters
    ----------
    tokenizer : object with ``encode(str) -> list[int]``, or a model with a ``tokenizer``
    n_tokens : int, default 512
        At most the length of the text (about 2,260 SmolLM2 tokens).

    Returns
    -------
    list of int
    """
    return text_token_ids(tokenizer, n_tokens, builtin_text, "the built-in text")


def builtin_long_text() -> str:
    """*Pride and Prejudice*, chapters 1-6 (public domain; about 42 KB, 10,050 SmolLM2 tokens)."""
    from ..data import read_long_text

    return read_long_text()


def builtin_long_token_ids(tokenizer: Any, n_tokens: int = 8448) -> list:
    """The first ``n_tokens`` token ids of :func:`builtin_long_text`.

    Parameters
    ----------
    tokenizer : object with ``encode(str) -> list[int]``, or a model with a ``tokenizer``
    n_tokens : int, default 8448
        At most the length of the text (about 10,050 SmolLM2 tokens).

    Returns
    -------
    list of int
        Starts with the same ids as :func:`builtin_token_ids` (the texts share chapters 1-2).
    """
    return text_token_ids(tokenizer, n_tokens, builtin_long_text, "the built-in long text")


def text_token_ids(tokenizer: Any, n_tokens: int, text: Callable[[], str], name: str) -> list:
    """The first ``n_tokens`` (>= 2) token ids of ``text()``; ``name`` labels it in errors."""
    tok = getattr(tokenizer, "tokenizer", None) or tokenizer
    if not hasattr(tok, "encode"):
        raise TypeError(f"tokenizer must have an encode method, received {type(tokenizer).__name__}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2:
        raise ValueError(f"n_tokens must be an integer >= 2, received {n_tokens!r}")
    ids = list(tok.encode(text()))
    if len(ids) < n_tokens:
        raise ValueError(f"{name} has {len(ids)} tokens, fewer than n_tokens={n_tokens}")
    return ids[:n_tokens]
