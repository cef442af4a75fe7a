"""Checks of command-line arguments that ``argparse`` types cannot make alone.

Every command checks all its arguments before it loads a model or opens a store: values against
each other (``--prefill`` below ``--tokens``), names against the registry
(:func:`arraykv.available_methods`), output paths against the file system, flags against the mode
that would ignore them. A refusal is a :class:`UsageError` (a ``ValueError``): ``python -m
arraykv`` prints it as one line, ``arraykv <command>: error: ...``, and exits with status 2, as
``argparse`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["UsageError", "check_methods", "check_distinct", "check_output_file", "check_output_folder", "refuse_with"]


class UsageError(ValueError):
    """A command-line argument that cannot work; the message names the flag."""


def check_methods(flag: str, names: Iterable[str]) -> list:
    """``names`` as a list, each a registered cache method and none twice.

    Parameters
    ----------
    flag : str
        The option, for the message (``"--methods"``).
    names : iterable of str

    Returns
    -------
    list of str

    Raises
    ------
    UsageError
        An unknown name (the message lists the available ones) or a name given twice.
    """
    from .caches import available_methods

    have = available_methods()
    names = list(names)
    unknown = [m for m in names if m not in have]
    if unknown:
        raise UsageError(f"{flag}: unknown methods {unknown}; available: {', '.join(have)}")
    return check_distinct(flag, names)


def check_distinct(flag: str, values: Sequence[Any]) -> list:
    """``values`` as a list, refused when one is given twice.

    Parameters
    ----------
    flag : str
    values : sequence

    Returns
    -------
    list
    """
    twice = sorted({v for v in values if list(values).count(v) > 1}, key=str)
    if twice:
        raise UsageError(f"{flag}: {', '.join(map(str, twice))} given more than once")
    return list(values)


def check_output_file(flag: str, path: str) -> None:
    """Refuse a file path that cannot be written: its folder missing or read-only, or a folder itself.

    Parameters
    ----------
    flag : str
    path : str
    """
    if os.path.isdir(path):
        raise UsageError(f"{flag}: {path!r} is a folder; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: the folder {folder!r} is not writable")


def check_output_folder(flag: str, path: str) -> None:
    """Refuse a folder that cannot be written or made (a file there, or a read-only parent).

    Parameters
    ----------
    flag : str
    path : str
    """
    here = os.path.abspath(path)
    while not os.path.exists(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    if not os.path.isdir(here):
        raise UsageError(f"{flag}: {here!r} is a file, not a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {here!r} is not writable")


def refuse_with(given: dict, mode: str) -> None:
    """Refuse the options in ``given`` (flag -> value, None where not given) that ``mode`` ignores.

    Parameters
    ----------
    given : dict of str to object
    mode : str
        What makes them not apply (``"--synthetic"``), for the message.
    """
    named = [flag for flag, value in given.items() if value is not None and value is not False]
    if named:
        raise UsageError(f"{', '.join(named)} {'does' if len(named) == 1 else 'do'} not apply with {mode}")
