"""Teacher-forced quality after a long prefix: what a compressed cache changes at 4k and 8k tokens.

For each prefix length ``P``: the first ``P`` tokens go once through the model with the exact
dense cache, in chunks (:func:`~arraykv.eval.exact_prefill`); each method's cache receives that
prefix (one ``cache.prefill`` per layer with the exact K/V/Q, or chunk by chunk through its own
cache with ``prefill_mode="cache"``); then ``ids[P : P + positions]`` are decoded one by one
through every cache and the exact one, and each decode step's logits, which predict
``ids[P + 1 : P + positions + 1]``, are compared with the exact cache's by
:func:`~arraykv.eval.compare`: KL(exact || method), top-1 agreement, perplexity and its change,
and bits per value with ``P + positions`` tokens held.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .exact_prefill import check_common, exact_prefill, held_rows, method_cache, progress_bar, stored_bytes
from .needle_result import format_markdown
from .teacher_forced import EvalRow, TeacherForced, compare
from .texts import builtin_long_token_ids

__all__ = ["LongTextResult", "long_text_quality"]


@dataclass(frozen=True)
class LongTextResult:
    """What :func:`long_text_quality` measured.

    Parameters
    ----------
    prefix_lengths : tuple of int
        The prefix lengths measured, in the order requested.
    positions : int
        Decoded (and scored) positions after each prefix.
    methods : tuple of str
        ``"dense"`` (the exact cache, KL 0) first.
    rows : tuple of EvalRow
        Per prefix length (in order) one row per method (in :attr:`methods` order). A row's
        ``tokens`` is ``P + positions`` and ``decoded`` is ``positions``, so
        ``P = tokens - decoded``.
    prefill_mode : {"exact", "cache", "cache-chunks"}
        How each method's cache received the prefix.
    """

    prefix_lengths: tuple
    positions: int
    methods: tuple
    rows: tuple
    prefill_mode: str

    def rows_at(self, prefix_length: int) -> list:
        """The rows (one per method) after a prefix of ``prefix_length`` tokens.

        Parameters
        ----------
        prefix_length : int
            One of :attr:`prefix_lengths`.

        Returns
        -------
        list of EvalRow
            One per method, in :attr:`methods` order.

        Raises
        ------
        KeyError
            ``prefix_length`` was not measured.
        """
        if prefix_length not in self.prefix_lengths:
            raise KeyError(f"prefix_length {prefix_length} was not measured; measured: {list(self.prefix_lengths)}")
        return [r for r in self.rows if r.tokens - r.decoded == prefix_length]

    def series(self, method: str, field: str = "mean_kl") -> list:
        """``[(prefix_length, value), ...]`` of one :class:`EvalRow` field for ``method``.

        Parameters
        ----------
        method : str
            One of :attr:`methods`.
        field : str, default "mean_kl"
            The name of an :class:`EvalRow` field.

        Returns
        -------
        list of tuple
            ``(prefix_length, value)`` per prefix length, in :attr:`prefix_lengths` order.

        Raises
        ------
        KeyError
            ``method`` was not measured.
        ValueError
            ``field`` is not an :class:`EvalRow` field.
        """
        if method not in self.methods:
            raise KeyError(f"method {method!r} was not measured; measured: {list(self.methods)}")
        if field not in EvalRow.__dataclass_fields__:
            raise ValueError(f"field must be an EvalRow field, received {field!r}")
        return [(r.tokens - r.decoded, getattr(r, field)) for r in self.rows if r.method == method]

    def format_table(self, *, markdown: bool = True) -> str:
        """One line per (prefix length, method): bits/value, perplexity and its change, KL, top-1, tokens/s.

        Parameters
        ----------
        markdown : bool, default True
            A Markdown table; False aligns plain-text columns instead.

        Returns
        -------
        str
            The header and one line per row.
        """
        head = ["method", "prefix", "bits/value", "perplexity", "ppl change", "mean KL", "top-1 agree", "tokens/s"]
        body = [
            [
                r.method,
                str(r.tokens - r.decoded),
                f"{r.bits_per_value:.2f}",
                f"{r.perplexity:.3f}",
                f"{r.ppl_change_pct:+.2f}%",
                f"{r.mean_kl:.5f}",
                f"{r.top1_agreement:.1%}",
                f"{r.decode_tokens_per_s:.1f}",
            ]
            for r in self.rows
        ]
        return format_markdown(head, body, markdown=markdown)


def long_text_quality(
    model: Any,
    methods: Sequence[str],
    *,
    prefix_lengths: Sequence[int] = (3840, 7936),
    positions: int = 256,
    token_ids: Any = None,
    chunk_size: int | None = 512,
    prefill_mode: str = "exact",
    cache_options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool = False,
    on_row: Callable[[int, EvalRow], None] | None = None,
) -> LongTextResult:
    """Teacher-forced quality of each method after long prefixes, against the exact cache.

    Parameters
    ----------
    model : DecoderModel
        Anything with ``config``, ``prefill``, ``decode`` and ``make_cache``
        (:func:`arraykv.integrations.decoder.gguf_loading.load_model`); with a tokenizer when
        ``token_ids`` is not given.
    methods : sequence of str
        Names from :func:`arraykv.available_methods`; the exact cache is always reported first,
        as ``"dense"``.
    prefix_lengths : sequence of int, default (3840, 7936)
        Tokens prefilled before the scored positions; ``P + positions`` must fit the model's
        context length (3840 + 256 = 4096, 7936 + 256 = 8192).
    positions : int, default 256
        Tokens decoded one by one after each prefix.
    token_ids : sequence of int, optional
        The text, at least ``max(prefix_lengths) + positions + 1`` tokens; by default the
        shipped *Pride and Prejudice* chapters 1-6 (:func:`builtin_long_token_ids`).
    chunk_size : int or None, default 512
        Tokens per prefill chunk.
    prefill_mode : {"exact", "cache", "cache-chunks"}, default "exact"
        How each method's cache receives the prefix (see the module docstring).
    cache_options : dict of str to dict, optional
        Extra ``make_cache`` options per method (not for "dense").
    progress : bool, default False
        A tqdm progress bar (when tqdm is installed).
    on_row : callable, optional
        Called as ``on_row(prefix_length, row)`` with each :class:`EvalRow` as soon as it is
        measured (a run at 32k tokens takes minutes per method: a caller can report rows as
        they come, and keep them if the run is stopped).

    Returns
    -------
    LongTextResult
        Per prefix length one :class:`EvalRow` per method, the exact cache's first.
    """
    methods, opts = check_common(model, methods, cache_options, chunk_size, prefill_mode)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be an integer >= 1, received {positions!r}")
    if isinstance(prefix_lengths, (str, bytes)) or not hasattr(prefix_lengths, "__iter__"):
        raise TypeError(f"prefix_lengths must be a sequence of int, received {type(prefix_lengths).__name__}")
    prefix_lengths = list(prefix_lengths)
    bad = [p for p in prefix_lengths if isinstance(p, bool) or not isinstance(p, int) or p < 1]
    if bad or not prefix_lengths or len(set(prefix_lengths)) != len(prefix_lengths):
        raise ValueError(f"prefix_lengths must be distinct integers >= 1, received {prefix_lengths!r}")
    limit = model.config.context_length
    over = [p for p in prefix_lengths if p + positions > limit]
    if over:
        raise ValueError(
            f"prefix_lengths {over} plus positions={positions} exceed the model's context length of {limit}"
        )
    need = max(prefix_lengths) + positions + 1
    if token_ids is None:
        ids = builtin_long_token_ids(model, need)
    else:
        from .. import _compat

        ids = [int(i) for i in (_compat.to_numpy(token_ids).tolist() if hasattr(token_ids, "shape") else token_ids)]
        if len(ids) < need:
            raise ValueError(
                f"token_ids must hold at least max(prefix_lengths) + positions + 1 = {need} tokens, received {len(ids)}"
            )
    c = model.config
    geometry = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    record = prefill_mode == "exact" and len(methods) > 1
    bar = progress_bar(progress, len(prefix_lengths) * len(methods), "long text")
    rows = []
    try:
        for p in prefix_lengths:
            exact = exact_prefill(model, ids[:p], chunk_size=chunk_size, record=record)
            targets = ids[p + 1 : p + positions + 1]
            ref = _decode(model, ids[p : p + positions], exact.cache, "dense")
            rows.append(compare(ref, ref, targets, **geometry))
            if on_row is not None:
                on_row(p, rows[-1])
            if bar is not None:
                bar.update(1)
            for m in methods[1:]:
                if bar is not None:
                    bar.set_postfix_str(f"{m} @ {p}")
                cache = method_cache(model, m, opts.get(m, {}), exact, ids[:p], prefill_mode, chunk_size)
                run = _decode(model, ids[p : p + positions], cache, m)
                del cache
                rows.append(compare(run, ref, targets, **geometry))
                if on_row is not None:
                    on_row(p, rows[-1])
                if bar is not None:
                    bar.update(1)
            del exact, ref
    finally:
        if bar is not None:
            bar.close()
    return LongTextResult(
        prefix_lengths=tuple(prefix_lengths),
        positions=positions,
        methods=tuple(methods),
        rows=tuple(rows),
        prefill_mode=prefill_mode,
    )


def _decode(model: Any, ids: list, cache: Any, method: str) -> TeacherForced:
    """Decode ``ids`` one by one through ``cache`` (holding the prefix), keeping every step's logits."""
    import numpy as np

    from .. import _compat

    out = np.empty((len(ids), model.config.vocab_size), dtype=np.float32)
    seconds = 0.0
    for j, t in enumerate(ids):
        t0 = time.perf_counter()
        lg = model.decode(t, cache)
        seconds += time.perf_counter() - t0
        out[j] = _compat.to_numpy(lg)
    return TeacherForced(
        method=method,
        logits=out,
        seconds=seconds,
        kv_bytes=stored_bytes(cache),
        tokens=int(cache.seq_len(0)),
        held_rows=held_rows(cache),
    )
