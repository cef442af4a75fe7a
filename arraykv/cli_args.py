"""Argument types of the command line: numbers checked when the arguments are parsed.

A bad value is refused by ``argparse`` at once (usage line, exit status 2), before a model is
loaded or a generation runs.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "nonnegative_int", "fraction", "code_bits"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, received {n}")
    return n


def nonnegative_int(text: str) -> int:
    """A whole number >= 0."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, received {n}")
    return n


def fraction(text: str) -> float:
    """A number in [0, 1] (a depth in a prompt)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], received {text}")
    return x


def code_bits(text: str) -> int:
    """Bits per coordinate of a scalar code: 1 to 4."""
    n = _int(text)
    if not 1 <= n <= 4:
        raise argparse.ArgumentTypeError(f"must be 1, 2, 3 or 4, received {n}")
    return n
