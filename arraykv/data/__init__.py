"""Text shipped with arraykv for quality evaluation.

``pride_and_prejudice_ch1-2.txt``: the first two chapters of *Pride and Prejudice* by Jane
Austen (1813), public domain (the text as printed in the novel's first edition, in
modern spelling as reproduced by Project Gutenberg eBook #1342). About 2,300 tokens with the
SmolLM2 tokenizer; :func:`arraykv.eval.builtin_text` reads it.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["TEXT_FILE", "read_text"]

TEXT_FILE = "pride_and_prejudice_ch1-2.txt"


def read_text(name: str = TEXT_FILE) -> str:
    """The content of a text file shipped in ``arraykv.data``."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
