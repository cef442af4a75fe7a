"""Text shipped with arraykv for quality evaluation.

Both files are from *Pride and Prejudice* by Jane Austen (1813), public domain (the text as
reproduced by Project Gutenberg eBook #1342), one paragraph per line:

``pride_and_prejudice_ch1-2.txt``
    The first two chapters, in modern spelling. About 2,300 tokens with the SmolLM2
    tokenizer; :func:`arraykv.eval.builtin_text` reads it.
``pride_and_prejudice_ch1-6.txt``
    The first six chapters (the same two chapters, then chapters 3-6). About 10,050 SmolLM2
    tokens, enough for long-context evaluation at 8k tokens;
    :func:`arraykv.eval.builtin_long_text` reads it.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["TEXT_FILE", "LONG_TEXT_FILE", "read_text", "read_long_text"]

TEXT_FILE = "pride_and_prejudice_ch1-2.txt"
LONG_TEXT_FILE = "pride_and_prejudice_ch1-6.txt"


def read_text(name: str = TEXT_FILE) -> str:
    """The content of a text file shipped in ``arraykv.data``."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def read_long_text() -> str:
    """The longer shipped text, :data:`LONG_TEXT_FILE` (chapters 1-6, about 42 KB)."""
    return read_text(LONG_TEXT_FILE)
