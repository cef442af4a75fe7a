"""The public-domain texts shipped for evaluation, as token ids.

:func:`builtin_text` is *Pride and Prejudice*, chapters 1-2, about
2,260 SmolLM2 tokens; :func:`builtin_long_text` is chapters 1-6 (the same two chapters first),
about 10,050 tokens: enough for a 7,936-token prefix followed by 256 scored positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "builtin_text",
    "builtin_token_ids",
    "builtin_long_text",
    "builtin_long_token_ids",
    "text_token_ids",
    "python_reference_text",
    "long_text_by_name",
]


def builtin_text() -> str:
    """The public-domain text shipped for evaluation (Pride and Prejudice, chapters 1-2).

    Returns
    -------
    str
        The text, read from the package's data.
    """
    from ..data import read_text

    return read_text()


def builtin_token_ids(tokenizer: Any, n_tokens: int = 512) -> list:
    """The first ``n_tokens`` token ids of :func:`builtin_text`.

    Parameters
    ----------
    tokenizer : object
        Anything with ``encode(str) -> list[int]``, or a model whose ``tokenizer`` attribute
        has one.
    n_tokens : int, default 512
        At most the length of the text (about 2,260 SmolLM2 tokens).

    Returns
    -------
    list of int
        The ids of the text's first ``n_tokens`` tokens.
    """
    return text_token_ids(tokenizer, n_tokens, builtin_text, "the built-in text")


def builtin_long_text() -> str:
    """*Pride and Prejudice*, chapters 1-6 (public domain; about 42 KB, 10,050 SmolLM2 tokens).

    Returns
    -------
    str
        The text, read from the package's data.
    """
    from ..data import read_long_text

    return read_long_text()


def builtin_long_token_ids(tokenizer: Any, n_tokens: int = 8448) -> list:
    """The first ``n_tokens`` token ids of :func:`builtin_long_text`.

    Parameters
    ----------
    tokenizer : object
        Anything with ``encode(str) -> list[int]``, or a model whose ``tokenizer`` attribute
        has one.
    n_tokens : int, default 8448
        At most the length of the text (about 10,050 SmolLM2 tokens).

    Returns
    -------
    list of int
        Starts with the same ids as :func:`builtin_token_ids` (the texts share chapters 1-2).
    """
    return text_token_ids(tokenizer, n_tokens, builtin_long_text, "the built-in long text")


def python_reference_text() -> str:
    """The Python language reference's topics as the interpreter ships them (``pydoc_data.topics``).

    Every CPython installation carries them (the text behind ``help("assert")``): about 465 KB of
    technical English with code, 110k-130k tokens, enough for prefixes of 32k tokens and more.
    The topics are joined in sorted order, separated by blank lines. The text differs a little
    between Python versions, so a figure measured on it names the version.
    """
    from pydoc_data import topics

    return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def long_text_by_name(name: str) -> tuple[str, str]:
    """A long evaluation text and its label: ``"book"``, ``"pydoc"`` or the path of a UTF-8 file.

    Returns
    -------
    (text, label) : tuple of str
        ``"book"``: :func:`builtin_long_text`; ``"pydoc"``: :func:`python_reference_text`; any
        other string is read as a file.
    """
    import platform

    if name == "book":
        return builtin_long_text(), "Pride and Prejudice ch. 1-6"
    if name == "pydoc":
        return python_reference_text(), f"the Python {platform.python_version()} language reference topics"
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"text must be 'book', 'pydoc' or a readable UTF-8 file; {name!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {name!r} is not UTF-8 ({exc.reason})") from exc
    if not text.strip():
        raise ValueError(f"text file {name!r} is empty")
    return text, f"the file {name}"


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
