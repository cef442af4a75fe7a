"""A picture of the long-context results: retrieval grids per method and KL against length.

Needs matplotlib (``pip install "arraykv[plot]"``); nothing else in :mod:`arraykv.eval` does.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["plot_long_context"]

_GREEN, _RED, _GREY = "#4caf50", "#e53935", "#bdbdbd"


def plot_long_context(
    path: str | os.PathLike, *, needle: Any = None, long_text: Any = None, title: str | None = None
) -> str:
    """Save a PNG of a needle grid and/or a long-text KL curve.

    Parameters
    ----------
    path : str or path-like
        The PNG file to write (its folder must exist).
    needle : NeedleResult, optional
        Drawn as one small grid per method: rows are lengths, columns depths; green where the
        key was retrieved, red where it was missed, grey where the exact cache missed too
        (such cells do not count). Each cell shows the key's log-probability in nats.
    long_text : LongTextResult, optional
        Drawn as the mean KL(exact || method) against the prefix length, one line per method,
        on a log scale (the exact cache, KL 0, is left out).
    title : str, optional
        Figure title.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ImportError
        matplotlib is not installed.
    ValueError
        Neither ``needle`` nor ``long_text`` given.
    """
    from .long_text import LongTextResult
    from .needle_result import NeedleResult

    if needle is None and long_text is None:
        raise ValueError("pass needle (a NeedleResult) and/or long_text (a LongTextResult) to plot")
    if needle is not None and not isinstance(needle, NeedleResult):
        raise TypeError(f"needle must be a NeedleResult, received {type(needle).__name__}")
    if long_text is not None and not isinstance(long_text, LongTextResult):
        raise TypeError(f"long_text must be a LongTextResult, received {type(long_text).__name__}")
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError('plotting needs matplotlib: pip install "arraykv[plot]"') from exc

    n_grid = len(needle.methods) if needle is not None else 0
    cols = max(n_grid, 1)
    rows = (1 if needle is not None else 0) + (1 if long_text is not None else 0)
    fig = Figure(figsize=(max(2.6 * cols, 6.0), 3.2 * rows + 0.6), layout="constrained")
    grid = fig.add_gridspec(rows, cols)
    row = 0
    if needle is not None:
        for i, m in enumerate(needle.methods):
            _draw_grid(fig.add_subplot(grid[row, i]), needle, m)
        row += 1
    if long_text is not None:
        _draw_kl(fig.add_subplot(grid[row, :]), long_text)
    if needle is not None:
        key = "green: retrieved, red: missed, grey: the exact cache missed\nin each cell: log p(key), nats"
        title = f"{title}\n{key}" if title else key
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(os.fspath(path), dpi=110)
    return os.fspath(path)


def _draw_grid(ax: Any, result: Any, method: str) -> None:
    from matplotlib.colors import ListedColormap

    lengths, depths = list(result.lengths), list(result.depths)
    codes, labels = [], []
    for n in lengths:
        code_row, label_row = [], []
        for d in depths:
            r = result.row(method, n, d)
            code_row.append(2 if not r.exact_retrieved else (1 if r.retrieved else 0))
            label_row.append(f"{r.key_logprob:.2f}")
        codes.append(code_row)
        labels.append(label_row)
    ax.imshow(codes, cmap=ListedColormap([_RED, _GREEN, _GREY]), vmin=0, vmax=2, aspect="auto")
    for y, label_row in enumerate(labels):
        for x, text in enumerate(label_row):
            ax.text(x, y, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d * 100:g}%" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xticks([x + 0.5 for x in range(len(depths) - 1)], minor=True)
    ax.set_yticks([y + 0.5 for y in range(len(lengths) - 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("needle depth")
    if method == result.methods[0]:
        ax.set_ylabel("context length (tokens)")
    got = [s for s in result.summary() if s.method == method][0]
    ax.set_title(
        f"{method}\n{got.retrieved}/{got.cells} retrieved, {got.retrieved_where_exact}/{got.exact_cells} where exact",
        fontsize=9,
    )


def _draw_kl(ax: Any, result: Any) -> None:
    drawn = 0
    for m in result.methods:
        pts = [(p, kl) for p, kl in result.series(m, "mean_kl") if kl > 0.0]
        if not pts:
            continue
        bits = [r.bits_per_value for r in result.rows if r.method == m]
        label = f"{m} ({sum(bits) / len(bits):.2f} bits/value)"
        ax.plot([p for p, _ in pts], [kl for _, kl in pts], marker="o", label=label)
        drawn += 1
    if drawn:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no method differs from the exact cache", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks(list(result.prefix_lengths))
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel(f"mean KL(exact || method), nats\nover {result.positions} decoded positions")
    ax.grid(True, which="both", alpha=0.3)
