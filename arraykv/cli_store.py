"""``python -m arraykv store``: what a prefix store holds (entries, tokens, bytes, ages), and eviction.

``python -m arraykv store ls STORE`` lists the entries of a store, newest use first, with their
whole keys, prefix tokens, bytes, and the total; ``store evict STORE --max-bytes N`` drops
expired entries and the least recently used ones beyond ``N`` bytes; ``store rm STORE KEY...``
removes the entries of those exact keys. ``STORE`` is what ``PrefixStore(store=...)`` takes
(:func:`arraykv.store.prefix.open_backend`): an existing folder, or a server URL
(``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``, ``unix://``, cluster URLs).
``--prefix`` names a server store's key prefix. Options that do not apply to the action or the
store (keys to ``ls``, ``--max-bytes`` to ``rm``, ``--prefix`` to a folder) are refused.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from .cli_args import positive_int
from .cli_checks import UsageError, check_distinct, refuse_with

if TYPE_CHECKING:
    from .store.backend import EntryInfo
    from .store.local import LocalStore
    from .store.valkey import ValkeyStore

__all__ = ["add_parser", "check", "run", "format_entries"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("store", help="list a prefix store's entries and bytes, evict, remove", description=__doc__)
    p.add_argument("action", choices=["ls", "evict", "rm"], help="ls: list entries; evict: trim; rm: remove keys")
    p.add_argument(
        "store", help="a store folder, or a server URL (redis://, valkey://, unix://, cluster URLs) as store= takes"
    )
    p.add_argument("keys", nargs="*", help="rm: the whole keys to remove, as `store ls` prints them")
    p.add_argument("--prefix", default=None, help="key prefix of a server store (default: arraykv:; not for a folder)")
    p.add_argument("--max-bytes", type=positive_int, default=None, help="evict (required): the byte budget to trim to")
    p.set_defaults(run=run)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.0f} s"


def format_entries(entries: list[EntryInfo], now: float | None = None) -> str:
    """A Markdown table of :class:`~arraykv.store.EntryInfo`, most recently used first, and the total."""
    now = time.time() if now is None else now
    rows = ["| key | tokens | bytes | created | last used | expires in |", "|---|---|---|---|---|---|"]
    for e in sorted(entries, key=lambda e: -e.last_used):
        expires = "-" if e.expires is None else _age(e.expires - now)
        rows.append(
            f"| {e.key} | {'?' if e.tokens is None else e.tokens} | {_size(e.nbytes)} | "
            f"{_age(now - e.created)} ago | {_age(now - e.last_used)} ago | {expires} |"
        )
    total = sum(e.nbytes for e in entries)
    rows.append(f"\n{len(entries)} entries, {_size(total)} ({total} bytes)")
    return "\n".join(rows)


def check(args: argparse.Namespace) -> None:
    """Check the arguments of ``store`` before the store is opened.

    ``ls`` takes no keys and no ``--max-bytes``; ``evict`` needs ``--max-bytes`` and takes no
    keys; ``rm`` needs whole keys (16-128 lower-case hexadecimal digits, never empty, none
    twice) and takes no ``--max-bytes``.

    Raises
    ------
    UsageError
        An argument that cannot work, naming it.
    """
    from .store.backend import check_key

    if args.action != "rm" and args.keys:
        raise UsageError(f"{args.action} takes no keys, received {' '.join(map(repr, args.keys))}")
    if args.action != "evict":
        refuse_with({"--max-bytes": args.max_bytes}, f"store {args.action}")
    elif args.max_bytes is None:
        raise UsageError("evict needs --max-bytes N: the byte budget to trim the store to")
    if args.action == "rm":
        if not args.keys:
            raise UsageError("rm needs at least one key (see `store ls`)")
        for key in args.keys:
            try:
                check_key(key)
            except ValueError:
                raise UsageError(
                    f"rm takes whole keys (16-128 lower-case hexadecimal digits, as `store ls` prints them), "
                    f"received {key!r}"[:300]
                ) from None
        check_distinct("rm", args.keys)


def _backend(args: argparse.Namespace) -> LocalStore | ValkeyStore:
    """The store ``args.store`` names, opened as ``PrefixStore(store=...)`` opens it."""
    import os
    import shutil

    from .store.local import LocalStore
    from .store.prefix import open_backend
    from .store.valkey import ValkeyStore

    spec = args.store
    folder = os.path.isdir(spec)
    if not folder and "://" not in spec:
        raise UsageError(f"no store folder at {spec} (nor a server URL such as redis://host:port)")
    if folder:
        refuse_with({"--prefix": args.prefix}, "a store folder")
    top = os.path.abspath(spec)  # what a folder store of a URL it does not take would make
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    made = not folder and not os.path.exists(top)
    backend = open_backend(spec)
    if isinstance(backend, LocalStore):
        if not folder:  # open_backend took the URL for a folder name: undo the folder it made
            if made:
                shutil.rmtree(top, ignore_errors=True)
            raise UsageError(f"{spec!r} is neither a store folder nor a server URL that store= takes")
        return backend
    if not isinstance(backend, ValkeyStore):
        raise UsageError(f"{spec!r} opened as a {type(backend).__name__}, not a folder or server store")
    if args.prefix is not None:  # the same connection, under the given prefix
        return ValkeyStore(backend.client, prefix=args.prefix)
    return backend


def run(args: argparse.Namespace) -> int:
    check(args)
    backend = _backend(args)
    if args.action == "ls":
        print(format_entries(backend.entries()))
    elif args.action == "evict":
        dropped = backend.evict(args.max_bytes)
        print(f"dropped {len(dropped)} entries; {format_entries(backend.entries()).rsplit(chr(10), 1)[-1]}")
    else:
        held = {e.key for e in backend.entries()}
        missing = [k for k in args.keys if k not in held]
        if missing:  # before removing any
            raise UsageError(f"the store holds no entry {missing[0]!r} (keys must be whole; see `store ls`)")
        for key in args.keys:
            backend.delete(key)
            print(f"removed {key}")
    return 0
