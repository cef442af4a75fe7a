"""``python -m arraykv bench``: run the benchmark scripts of a source checkout and print their tables."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

__all__ = ["add_parser", "run", "find_benchmarks"]


def find_benchmarks(root: str | None = None) -> list[Path]:
    """The ``benchmarks/*.py`` scripts next to the package (a source checkout), sorted.

    Raises
    ------
    FileNotFoundError
        No ``benchmarks`` folder: arraykv was installed from a wheel rather than a checkout.
    """
    base = Path(root) if root else Path(__file__).resolve().parents[1] / "benchmarks"
    if not base.is_dir():
        raise FileNotFoundError(
            f"no benchmarks folder at {base}; the benchmarks ship with the source repository: "
            "clone it and run `python -m arraykv bench` from there, or pass --dir"
        )
    return sorted(p for p in base.glob("*.py") if not p.name.startswith("_"))


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench", help="run the benchmark scripts (benchmarks/*.py) and print their tables", description=__doc__
    )
    p.add_argument("--only", nargs="+", default=None, help="script names to run (e.g. quality)")
    p.add_argument("--dir", default=None, help="the benchmarks folder (default: the checkout's benchmarks/)")
    p.add_argument("--list", action="store_true", help="list the scripts and exit")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scripts = find_benchmarks(args.dir)
    if args.only:
        wanted = {n.removesuffix(".py") for n in args.only}
        missing = wanted - {p.stem for p in scripts}
        if missing:
            raise ValueError(f"no benchmark named {sorted(missing)}; found: {', '.join(p.stem for p in scripts)}")
        scripts = [p for p in scripts if p.stem in wanted]
    if args.list or not scripts:
        print("\n".join(p.stem for p in scripts) or "no benchmark scripts found")
        return 0
    failed: list[str] = []
    for script in scripts:
        print(f"\n=== {script.stem} ({script}) ===", flush=True)
        rc = subprocess.call([sys.executable, str(script)])
        if rc != 0:
            failed.append(script.stem)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
