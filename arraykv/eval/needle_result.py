"""Bookkeeping of a needle grid: the prompt of a cell, one row per (length, depth, method), summaries, table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["NeedlePrompt", "NeedleRow", "NeedleSummary", "NeedleResult", "format_markdown"]


@dataclass(frozen=True)
class NeedlePrompt:
    """The token ids of one needle cell.

    Parameters
    ----------
    prompt_ids : list of int
        ``intro + haystack[:i] + needle + haystack[i:]``: what is prefilled.
    question_ids : list of int
        Decoded one by one after the prompt; ``len(prompt_ids) + len(question_ids) == length``.
    target_ids : list of int
        Tokens of ``answer_prefix + key``, scored teacher-forced after the question.
    key : str
        The pass key of the cell, as written in the needle.
    needle_start : int
        Index in ``prompt_ids`` of the needle's first token.
    needle_tokens : int
        Tokens of the needle sentence.
    haystack_tokens : int
        Filler tokens in the prompt.
    depth : float
        Requested depth; ``(needle_start - len(intro)) / haystack_tokens`` is the one used.
    """

    prompt_ids: list
    question_ids: list
    target_ids: list
    key: str
    needle_start: int
    needle_tokens: int
    haystack_tokens: int
    depth: float

    @property
    def length(self) -> int:
        """Prompt plus question tokens."""
        return len(self.prompt_ids) + len(self.question_ids)


@dataclass(frozen=True)
class NeedleRow:
    """One method in one cell of the grid.

    Parameters
    ----------
    method : str
        The cache method (``"dense"`` for the exact cache).
    length : int
        Prompt plus question tokens.
    depth : float
        Requested needle depth in [0, 1].
    key : str
        The pass key hidden in the filler.
    answer : str
        The greedy answer text.
    retrieved : bool
        ``key in answer``.
    exact_retrieved : bool
        Whether the exact cache retrieved this cell.
    key_logprob : float
        ``sum log p(target token)`` in nats, teacher-forced after the question, over the tokens
        of ``answer_prefix + key``; 0 is certainty.
    bits_per_value : float
        ``used_bytes() * 8 / (2 * layers * kv_heads * tokens * head_dim)`` once the cache
        holds the prompt and the question.
    kv_bytes : int
        ``used_bytes()`` at that moment.
    tokens : int
        Tokens the cache held then (``length``).
    needle_start : int
        Token index of the needle in the prompt.
    seconds : float
        Wall time of the question, the answer and the scoring (the prefill not included).
    """

    method: str
    length: int
    depth: float
    key: str
    answer: str
    retrieved: bool
    exact_retrieved: bool
    key_logprob: float
    bits_per_value: float
    kv_bytes: int
    tokens: int
    needle_start: int
    seconds: float

    def as_dict(self) -> dict:
        """The row as a plain dict.

        Returns
        -------
        dict
            Field name to value, every field of the row.
        """
        return asdict(self)


@dataclass(frozen=True)
class NeedleSummary:
    """One method over the whole grid.

    Parameters
    ----------
    method : str
        The cache method (``"dense"`` for the exact cache).
    cells : int
        Cells of the grid the method ran.
    retrieved : int
        Cells where the key is in the answer.
    exact_cells : int
        Cells the exact cache retrieves.
    retrieved_where_exact : int
        Cells retrieved among those: a cell counts only where the exact cache retrieves.
    mean_key_logprob : float
        Mean over the cells of :attr:`NeedleRow.key_logprob`.
    length : int
        The longest length of the grid.
    bits_per_value : float
        Mean bits per value at that length.
    """

    method: str
    cells: int
    retrieved: int
    exact_cells: int
    retrieved_where_exact: int
    mean_key_logprob: float
    length: int
    bits_per_value: float


@dataclass(frozen=True)
class NeedleResult:
    """What :func:`needle_grid` measured.

    Parameters
    ----------
    rows : tuple of NeedleRow
        Cell by cell (lengths outer, depths inner), methods in :attr:`methods` order.
    methods : tuple of str
        ``"dense"`` (the exact cache) first.
    lengths : tuple of int
        The grid's context lengths, as requested.
    depths : tuple of float
        The grid's needle depths, as requested.
    prefill_mode : {"exact", "cache", "cache-chunks"}
        How each method's cache received the prompt.
    task : NeedleTask
        The texts, keys and answer length of the cells.
    """

    rows: tuple[NeedleRow, ...]
    methods: tuple
    lengths: tuple
    depths: tuple
    prefill_mode: str
    task: Any

    def row(self, method: str, length: int, depth: float) -> NeedleRow:
        """The row of ``method`` in cell ``(length, depth)``.

        Parameters
        ----------
        method : str
            One of :attr:`methods`.
        length : int
            One of :attr:`lengths`.
        depth : float
            One of :attr:`depths`.

        Returns
        -------
        NeedleRow
            The row measured there.

        Raises
        ------
        KeyError
            No row of ``method`` in that cell.
        """
        for r in self.rows:
            if r.method == method and r.length == length and r.depth == float(depth):
                return r
        raise KeyError(f"no row for method {method!r} at length {length}, depth {depth}")

    def summary(self) -> list:
        """One :class:`NeedleSummary` per method, in :attr:`methods` order.

        Returns
        -------
        list of NeedleSummary
            One per method, over every cell of the grid.
        """
        longest = max(self.lengths)
        out = []
        for m in self.methods:
            rs = [r for r in self.rows if r.method == m]
            at = [r.bits_per_value for r in rs if r.length == longest]
            out.append(
                NeedleSummary(
                    method=m,
                    cells=len(rs),
                    retrieved=sum(r.retrieved for r in rs),
                    exact_cells=sum(r.exact_retrieved for r in rs),
                    retrieved_where_exact=sum(r.retrieved and r.exact_retrieved for r in rs),
                    mean_key_logprob=math.fsum(r.key_logprob for r in rs) / len(rs) if rs else float("nan"),
                    length=longest,
                    bits_per_value=math.fsum(at) / len(at) if at else float("nan"),
                )
            )
        return out

    def format_grid(self, *, markdown: bool = True) -> str:
        """The grid as a table: a column per cell, then the totals and bits/value at the longest length.

        A cell reads ``✓`` (retrieved) or ``✗`` (missed) and the key's log-probability in nats;
        it is in parentheses where the exact cache missed (such cells do not count in "where
        exact"). "retrieved" counts all cells, "where exact" only those the exact cache
        retrieves.

        Parameters
        ----------
        markdown : bool, default True
            A Markdown table; False aligns plain-text columns instead.

        Returns
        -------
        str
            The header and one line per method.
        """
        cells = [(n, d) for n in self.lengths for d in self.depths]
        longest = max(self.lengths)
        head = (
            ["method"]
            + [f"{n}@{_pct(d)}" for n, d in cells]
            + ["retrieved", "where exact", "mean log p(key)", f"bits/value @{longest}"]
        )
        body = []
        for s in self.summary():
            row = [s.method]
            for n, d in cells:
                r = self.row(s.method, n, d)
                mark = f"{'✓' if r.retrieved else '✗'} {r.key_logprob:.2f}"
                row.append(mark if r.exact_retrieved else f"({mark})")
            row += [
                f"{s.retrieved}/{s.cells}",
                f"{s.retrieved_where_exact}/{s.exact_cells}",
                f"{s.mean_key_logprob:.3f}",
                f"{s.bits_per_value:.2f}",
            ]
            body.append(row)
        return format_markdown(head, body, markdown=markdown)

    def as_dicts(self) -> list:
        """Every row as a plain dict.

        Returns
        -------
        list of dict
            :meth:`NeedleRow.as_dict` of each row, in :attr:`rows` order.
        """
        return [r.as_dict() for r in self.rows]


def _pct(depth: float) -> str:
    return f"{depth * 100:g}%"


def format_markdown(head: Sequence[str], body: Sequence[Sequence[str]], *, markdown: bool = True) -> str:
    """``head`` and ``body`` (lists of cell strings) as a Markdown or aligned plain-text table."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head)] + [line(row) for row in body])
