"""``python -m arraykv store``: what a prefix store holds (entries, tokens, bytes, ages), and eviction.

``python -m arraykv store ls STORE`` lists the entries of a folder or a ``redis://`` server,
newest use first, with their prefix tokens, bytes, and the total; ``store evict STORE
--max-bytes N`` drops expired entries and the least recently used ones beyond ``N`` bytes;
``store rm STORE KEY...`` removes entries. ``--prefix`` names a server store's key prefix.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from .cli_args import positive_int

if TYPE_CHECKING:
    from .store.backend import EntryInfo
    from .store.local import LocalStore
    from .store.valkey import ValkeyStore

__all__ = ["add_parser", "run", "format_entries"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("store", help="list a prefix store's entries and bytes, evict, remove", description=__doc__)
    p.add_argument("action", choices=["ls", "evict", "rm"], help="ls: list entries; evict: trim; rm: remove keys")
    p.add_argument("store", help="a store folder, or a redis:// URL of a Valkey/Redis server")
    p.add_argument("keys", nargs="*", help="keys to remove (rm)")
    p.add_argument("--prefix", default="arraykv:", help="key prefix of a server store (default: arraykv:)")
    p.add_argument("--max-bytes", type=positive_int, default=None, help="evict: the byte budget to trim to")
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
            f"| {e.key[:16]} | {'?' if e.tokens is None else e.tokens} | {_size(e.nbytes)} | "
            f"{_age(now - e.created)} ago | {_age(now - e.last_used)} ago | {expires} |"
        )
    total = sum(e.nbytes for e in entries)
    rows.append(f"\n{len(entries)} entries, {_size(total)} ({total} bytes)")
    return "\n".join(rows)


def _backend(args: argparse.Namespace) -> LocalStore | ValkeyStore:
    from .store.local import LocalStore
    from .store.valkey import ValkeyStore

    if args.store.startswith(("redis://", "rediss://", "unix://")):
        return ValkeyStore(args.store, prefix=args.prefix)
    import os

    if not os.path.isdir(args.store):
        raise FileNotFoundError(f"no store folder at {args.store}")
    return LocalStore(args.store)


def run(args: argparse.Namespace) -> int:
    backend = _backend(args)
    if args.action == "ls":
        print(format_entries(backend.entries()))
    elif args.action == "evict":
        dropped = backend.evict(args.max_bytes)
        print(f"dropped {len(dropped)} entries; {format_entries(backend.entries()).rsplit(chr(10), 1)[-1]}")
    else:
        if not args.keys:
            raise ValueError("rm needs at least one key (see `store ls`)")
        full = {e.key for e in backend.entries()}
        for k in args.keys:
            matches = [f for f in full if f.startswith(k)]
            if len(matches) != 1:
                raise ValueError(f"key {k!r} matches {len(matches)} entries; give more of it")
            backend.delete(matches[0])
            print(f"removed {matches[0]}")
    return 0
