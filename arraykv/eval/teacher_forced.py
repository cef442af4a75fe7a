"""Teacher-forced quality evaluation of KV-cache methods on a real model.

The protocol: a fixed text of ``N`` tokens; the first ``prefill`` go through
``cache.prefill``, then every further token ``ids[i]`` (``i = prefill .. N-2``) through
``cache.decode``, and the logits of that step predict ``ids[i+1]``. The exact dense cache is run
once; each method is run once and compared with it position by position.

Main entry point::

    evaluate(model, token_ids, methods, *, prefill=64, cache_options=None, progress=False,
             exact=None) -> list[EvalRow]

Metrics of an :class:`EvalRow` (over the ``N - prefill - 1`` decoded positions):

``perplexity``
    ``exp(mean(-log p(ids[i+1])))`` under the method's logits.
``ppl_change`` / ``ppl_change_pct``
    ``perplexity - exact perplexity`` and the same in percent of the exact perplexity.
``mean_kl``
    Mean of ``KL(p_exact || p_method) = Σ p_exact (log p_exact - log p_method)`` in nats.
``top1_agreement``
    Fraction of positions where the arg-max token equals the exact cache's.
``max_abs_logit_diff``
    Largest ``|logit_method - logit_exact|``.
``bits_per_value``
    ``used_bytes() * 8 / (2 * layers * kv_heads * tokens * head_dim)`` after the run
    (``tokens`` = tokens the cache holds, ``N - 1``).
``kv_bytes`` / ``f16_ratio``
    ``used_bytes()`` and its ratio to float16 K/V of the same tokens (``bits_per_value / 16``).
``decode_tokens_per_s``
    Decode steps per second of wall time spent in the model's decode calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import _compat
from .._types import Array
from .engine import context_length, decode_logits, geometry
from .exact_prefill import held_rows, stored_bytes
from .texts import builtin_text, builtin_token_ids

__all__ = [
    "EvalRow",
    "TeacherForced",
    "builtin_text",
    "builtin_token_ids",
    "teacher_forced",
    "compare",
    "evaluate",
    "calibrate",
    "format_table",
]


@dataclass(frozen=True)
class TeacherForced:
    """The logits of one teacher-forced run.

    Parameters
    ----------
    method : str
        Label of the run (the cache method's name by default).
    logits : numpy.ndarray, shape (N - prefill - 1, vocab), float32
        Row ``j`` is the decode step on ``ids[prefill + j]`` and predicts ``ids[prefill + j + 1]``.
    seconds : float
        Wall time of the decode steps.
    kv_bytes : int
        ``cache.used_bytes()`` after the run (``memory_usage()`` for a cache without it).
    tokens : int
        Tokens the cache holds after the run (``N - 1``).
    held_rows : int or None
        Token rows held over all layers when they are fewer than ``layers * tokens`` (a hybrid
        cache's sliding layers hold their window); None otherwise.
    """

    method: str
    logits: Array
    seconds: float
    kv_bytes: int
    tokens: int
    held_rows: int | None = None


@dataclass(frozen=True)
class EvalRow:
    """One method's quality numbers (see the module docstring for the definitions).

    Parameters
    ----------
    method : str
        Label of the run (the cache method's name).
    tokens : int
        Tokens the cache holds after the run (``N - 1``).
    decoded : int
        Decoded positions compared (``N - prefill - 1``).
    perplexity : float
        ``exp(mean(-log p(ids[i+1])))`` under the method's logits.
    ppl_change : float
        ``perplexity`` minus the exact cache's perplexity.
    ppl_change_pct : float
        ``ppl_change`` in percent of the exact cache's perplexity.
    mean_kl : float
        Mean ``KL(p_exact || p_method)`` over the positions, in nats.
    top1_agreement : float
        Fraction of positions whose arg-max token equals the exact cache's.
    max_abs_logit_diff : float
        Largest ``|logit_method - logit_exact|`` over positions and vocabulary.
    bits_per_value : float
        Stored bits per key or value of the tokens held.
    kv_bytes : int
        Bytes the cache holds after the run (``used_bytes()``, else ``memory_usage()``).
    f16_ratio : float
        ``kv_bytes`` over float16 keys and values of the same tokens (``bits_per_value / 16``).
    decode_tokens_per_s : float
        Decode steps per second of wall time spent in the model's decode calls (infinite when
        no time was measured).
    """

    method: str
    tokens: int
    decoded: int
    perplexity: float
    ppl_change: float
    ppl_change_pct: float
    mean_kl: float
    top1_agreement: float
    max_abs_logit_diff: float
    bits_per_value: float
    kv_bytes: int
    f16_ratio: float
    decode_tokens_per_s: float

    def as_dict(self) -> dict:
        """The row as a plain dict.

        Returns
        -------
        dict
            Field name to value, every field of the row.
        """
        return asdict(self)


def _as_ids(model: Any, token_ids: Any, least: int, least_text: str | None = None) -> list:
    """``token_ids`` as a list of int, at least ``least`` and at most the model's context length."""
    ids = [int(i) for i in (_compat.to_numpy(token_ids).tolist() if hasattr(token_ids, "shape") else token_ids)]
    if len(ids) < least:
        raise ValueError(f"token_ids must hold at least {least_text or least} tokens, received {len(ids)}")
    limit = context_length(model)
    if limit is not None and len(ids) > limit:
        raise ValueError(f"token_ids has {len(ids)} tokens, more than the model's context length {limit}")
    return ids


def _check_ids(model: Any, token_ids: Any, prefill: int) -> list:
    if isinstance(prefill, bool) or not isinstance(prefill, int) or prefill < 1:
        raise ValueError(f"prefill must be an integer >= 1, received {prefill!r}")
    return _as_ids(model, token_ids, prefill + 2, f"prefill + 2 = {prefill + 2}")


def teacher_forced(
    model: Any, token_ids: Any, cache: Any = None, *, prefill: int = 64, method: str | None = None, progress: Any = None
) -> TeacherForced:
    """Run ``token_ids`` through ``model`` with ``cache``: prefill, then one decode per token.

    Parameters
    ----------
    model : DecoderModel or OrtKVDecoder
        Anything with ``prefill(ids, cache)``, ``decode(id, cache)`` and ``make_cache(method)``.
    token_ids : sequence of int, length N >= prefill + 2
        The text; at most the model's context length.
    cache : CompressedKVCache, optional
        Empty; it holds ``N - 1`` tokens afterwards. By default ``model.make_cache("dense")``.
    prefill : int, default 64
        Tokens stored with one ``model.prefill``; the rest but the last are decoded one by one.
    method : str, optional
        Label of the run (default: ``cache.method`` or the class name).
    progress : callable, optional
        Called with the number of decode steps done so far, after each one.

    Returns
    -------
    TeacherForced
        Its ``logits`` (N - prefill - 1, vocab) float32 are comparable between engines: two
        engines of the same model give the same rows up to their arithmetic.

    Examples
    --------
    Compare a GGUF model with its ONNX export on one text::

        a = teacher_forced(model, ids).logits                   # doctest: +SKIP
        b = teacher_forced(decoder, ids).logits                 # doctest: +SKIP
        print(abs(a - b).max())                                 # doctest: +SKIP
    """
    import numpy as np

    ids = _check_ids(model, token_ids, prefill)
    if cache is None:
        cache = model.make_cache("dense")
    elif cache.seq_len(0) != 0:
        raise ValueError("cache must be empty; call cache.reset() first")
    label = method or getattr(cache, "method", None) or type(cache).__name__
    model.prefill(ids[:prefill], cache)
    n = len(ids) - prefill - 1
    out = None
    seconds = 0.0
    for j in range(n):
        t0 = time.perf_counter()
        lg = decode_logits(model, ids[prefill + j], cache)
        seconds += time.perf_counter() - t0
        if out is None:
            out = np.empty((n, lg.shape[0]), dtype=np.float32)
        out[j] = lg
        if progress is not None:
            progress(j + 1)
    return TeacherForced(
        method=label,
        logits=out,
        seconds=seconds,
        kv_bytes=stored_bytes(cache),
        tokens=int(cache.seq_len(0)),
        held_rows=held_rows(cache),
    )


def calibrate(model: Any, token_ids: Any, method: Any) -> list:
    """Fit one :class:`~arraykv.KVCacheCompressor` per layer on the K/V ``model`` makes for ``token_ids``.

    The result is the ``calibration`` option of the ``lowrank`` and ``vq`` caches: bases or
    codebooks fitted once, on a text of the user's choice, instead of on the first tokens of
    every sequence.

    Parameters
    ----------
    model : DecoderModel or OrtKVDecoder
        Anything with ``prefill(ids, cache)`` and ``make_cache(method)``.
    token_ids : sequence of int
        The calibration text (at least 2 tokens, at most the context length). Use a text other
        than the one evaluated.
    method : LowRank or VectorQuantization
        What to fit (:class:`arraykv.LowRank`, :class:`arraykv.VectorQuantization`).

    Returns
    -------
    list of KVCacheCompressor
        One fitted compressor per layer, in layer order.

    Notes
    -----
    The K/V are those of the exact dense cache after one prefill of ``token_ids`` (keys after
    RoPE, as a cache sees them), so a basis or codebook covers the positions of the
    calibration text.
    """
    from ..compressor import KVCacheCompressor

    ids = _as_ids(model, token_ids, 2)
    dense = model.make_cache("dense")
    model.prefill(ids, dense)
    out = []
    for layer in range(geometry(model)["num_layers"]):
        kv = dense.dequantize(layer)
        out.append(KVCacheCompressor(method).fit(kv.k, kv.v))
    return out


def _log_softmax(z: Array) -> Array:
    import numpy as np

    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(
    run: TeacherForced,
    exact: TeacherForced,
    targets: Sequence[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> EvalRow:
    """Metrics of ``run`` against ``exact`` (see the module docstring).

    Parameters
    ----------
    run, exact : TeacherForced
        Same text and prefill.
    targets : sequence of int, length ``run.logits.shape[0]``
        The token each row predicts.
    num_layers, num_kv_heads, head_dim : int
        Model geometry, for bits per value.

    Returns
    -------
    EvalRow
        The metrics of ``run``, over its ``run.logits.shape[0]`` positions.
    """
    import numpy as np

    n = run.logits.shape[0]
    if exact.logits.shape != run.logits.shape or len(targets) != n:
        raise ValueError("run, exact and targets must cover the same positions")
    tgt = np.asarray(targets, dtype=np.int64)
    nll_r = nll_e = kl = 0.0
    agree = 0
    max_diff = 0.0
    chunk = 64
    for s in range(0, n, chunk):
        lr = _log_softmax(run.logits[s : s + chunk])
        le = _log_softmax(exact.logits[s : s + chunk])
        rows = np.arange(lr.shape[0])
        t = tgt[s : s + chunk]
        nll_r -= float(lr[rows, t].sum())
        nll_e -= float(le[rows, t].sum())
        kl += float((np.exp(le) * (le - lr)).sum())
        agree += int((run.logits[s : s + chunk].argmax(-1) == exact.logits[s : s + chunk].argmax(-1)).sum())
        max_diff = max(max_diff, float(np.abs(run.logits[s : s + chunk] - exact.logits[s : s + chunk]).max()))
    ppl = math.exp(nll_r / n)
    ppl_e = math.exp(nll_e / n)
    held = num_layers * run.tokens if run.held_rows is None else run.held_rows
    values = 2 * num_kv_heads * held * head_dim
    bits = run.kv_bytes * 8.0 / values
    return EvalRow(
        method=run.method,
        tokens=run.tokens,
        decoded=n,
        perplexity=ppl,
        ppl_change=ppl - ppl_e,
        ppl_change_pct=100.0 * (ppl - ppl_e) / ppl_e,
        mean_kl=max(kl / n, 0.0),
        top1_agreement=agree / n,
        max_abs_logit_diff=max_diff,
        bits_per_value=bits,
        kv_bytes=run.kv_bytes,
        f16_ratio=bits / 16.0,
        decode_tokens_per_s=n / run.seconds if run.seconds > 0 else float("inf"),
    )


def evaluate(
    model: Any,
    token_ids: Any,
    methods: Sequence[str],
    *,
    prefill: int = 64,
    cache_options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool = False,
    exact: TeacherForced | None = None,
) -> list:
    """Teacher-forced quality of each cache method against the exact dense cache.

    Parameters
    ----------
    model : DecoderModel or OrtKVDecoder
        From :func:`arraykv.integrations.decoder.gguf_loading.load_model`, or an ONNX decoder.
    token_ids : sequence of int, length N >= prefill + 2
        For example ``builtin_token_ids(model, 512)``.
    methods : sequence of str
        Names from :func:`arraykv.available_methods`. ``"dense"`` reuses the exact run.
    prefill : int, default 64
        Tokens stored with ``cache.prefill``; the rest are decoded one by one.
    cache_options : dict of str to dict, optional
        Extra ``make_cache`` options per method name, e.g. ``{"pqo3": {"outliers": 8}}``.
    progress : bool, default False
        Show a tqdm progress bar per run (when tqdm is installed).
    exact : TeacherForced, optional
        A dense run of the same ``token_ids`` and ``prefill`` to reuse (skips that run).

    Returns
    -------
    list of EvalRow
        In the order of ``methods``. Each method is run once; the dense reference once.

    Raises
    ------
    ValueError
        Unknown method, too few tokens, or ``cache_options`` naming a method not evaluated.
    """
    from ..caches import available_methods

    ids = _check_ids(model, token_ids, prefill)
    if isinstance(methods, str):
        raise TypeError("methods must be a sequence of method names, not a single string")
    methods = list(methods)
    known = set(available_methods())
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; available: {', '.join(sorted(known))}")
    opts = dict(cache_options or {})
    stray = [m for m in opts if m not in methods]
    if stray:
        raise ValueError(f"cache_options names methods that are not evaluated: {stray}")
    shape = geometry(model)
    targets = ids[prefill + 1 :]
    if exact is None:
        exact = _run(model, ids, "dense", {}, prefill, progress)
    elif exact.logits.shape[0] != len(targets):
        raise ValueError("exact does not cover the same positions as token_ids and prefill")
    rows = []
    for m in methods:
        run = exact if (m == "dense" and not opts.get(m)) else _run(model, ids, m, opts.get(m, {}), prefill, progress)
        rows.append(compare(run, exact, targets, **shape))
    return rows


def _run(model: Any, ids: list, method: str, options: Mapping[str, Any], prefill: int, progress: bool) -> TeacherForced:
    cache = model.make_cache(method, **dict(options))
    n = len(ids) - prefill - 1
    bar = _bar(progress, n, method)
    try:
        return teacher_forced(
            model,
            ids,
            cache,
            prefill=prefill,
            method=method,
            progress=None if bar is None else (lambda _j: bar.update(1)),
        )
    finally:
        if bar is not None:
            bar.close()


def _bar(enabled: bool, total: int, label: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{label:>8}", unit="tok", leave=False)


_COLUMNS = (
    ("method", "method", "{}"),
    ("bits/value", "bits_per_value", "{:.2f}"),
    ("KV vs f16", "f16_ratio", "{:.3f}"),
    ("perplexity", "perplexity", "{:.3f}"),
    ("ppl change", "ppl_change_pct", "{:+.2f}%"),
    ("mean KL", "mean_kl", "{:.5f}"),
    ("top-1 agree", "top1_agreement", "{:.1%}"),
    ("tokens/s", "decode_tokens_per_s", "{:.1f}"),
)


def format_table(rows: Sequence[EvalRow], *, markdown: bool = True) -> str:
    """The rows as a Markdown (or aligned plain-text) table.

    Parameters
    ----------
    rows : sequence of EvalRow
        One table row each, in order.
    markdown : bool, default True
        A Markdown table; False aligns plain-text columns instead.

    Returns
    -------
    str
        The header and one line per row (method, bits per value, ratio to float16,
        perplexity, its change, mean KL, top-1 agreement, decode tokens per second).
    """
    head = [h for h, _, _ in _COLUMNS]
    body = [[fmt.format(getattr(r, key)) for _, key, fmt in _COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt_row(head)] + [fmt_row(row) for row in body])
