"""Where the CUDA sources are: ``arraykv.kernels`` (the top-level ``kernels/`` folder).

An installed wheel (or an editable install) maps the package ``arraykv.kernels`` to that
folder; a plain source checkout on ``PYTHONPATH`` has no such package, and the sources are then
read from ``kernels/`` beside the ``arraykv`` folder.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = ["kernel_source", "kernel_names"]


def _root() -> Traversable | Path:
    try:
        return resources.files("arraykv.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "kernels"


def kernel_names() -> list[str]:
    """Names of the ``.cu`` files that ship with the package, sorted."""
    return sorted(p.name for p in _root().iterdir() if p.name.endswith(".cu"))


def kernel_source(name: str) -> tuple[str, Path]:
    """Return ``(text, path)`` of kernel source ``name`` (for example ``"decode_attn.cu"``).

    Raises
    ------
    FileNotFoundError
        If no such source ships with the package.
    """
    entry = _root() / name
    if not entry.is_file():
        raise FileNotFoundError(f"CUDA source {name!r} not found; available: {', '.join(kernel_names()) or 'none'}")
    return entry.read_text(encoding="utf-8"), Path(str(entry))
