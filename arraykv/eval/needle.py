"""Needle retrieval at long context: is a pass key hidden in filler text still found through the cache?

The task (:class:`NeedleTask`): an instruction, then filler text (``haystack``) repeated to
fill the context, with one sentence holding a random pass key (``needle``) inserted at a given
depth; then a question. The model answers greedily; the cell counts as retrieved when the key
occurs in the answer text.

Protocol of one cell ``(length, depth)``, run by :func:`needle_grid`:

1. the prompt (everything before the question) goes once through the model with the exact
   dense cache, in chunks (:func:`~arraykv.eval.exact_prefill`);
2. for every method (``dense`` = the exact cache itself, always included) a cache holding the
   prompt: by default filled with ONE ``cache.prefill(layer, K, V, Q)`` per layer from the
   exact pass (``prefill_mode="exact"``), or chunk by chunk through the method's own cache
   (``prefill_mode="cache"``);
3. the question tokens go through ``model.decode`` one by one (the cache now holds ``length``
   tokens: its bits per value are measured here), then ``answer_tokens`` greedy tokens;
4. the teacher-forced log-probability of the key's tokens (``answer_prefix + key``) after the
   question: a graded margin, more sensitive than retrieved / missed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._types import Array
from .exact_prefill import bits_per_value, check_common, exact_prefill, method_cache, progress_bar
from .needle_result import NeedlePrompt, NeedleResult, NeedleRow

__all__ = ["NeedleTask", "NeedlePrompt", "needle_grid", "FILLER", "INTRO"]

#: The classic filler of pass-key retrieval tests.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: The default instruction before the filler.
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
_SENTENCE_ENDS = (".", "!", "?", "\n")


@dataclass(frozen=True)
class NeedleTask:
    """Everything a needle cell is made of (text, key, answer length), all configurable.

    Parameters
    ----------
    haystack : str, default :data:`FILLER`
        Filler text, repeated (joined by a space) to fill the context; ``"book"`` means the
        shipped *Pride and Prejudice* chapters 1-6 (:func:`~arraykv.eval.builtin_long_text`,
        repeated if needed).
    intro : str, default :data:`INTRO`
        Instruction before the filler.
    needle : str, default ``" The pass key is {key}. Remember it. "``
        The inserted sentence; ``{key}`` is replaced by the cell's key.
    question : str, default ``"\\nWhat is the pass key? The pass key is "``
        Asked after the filler (decoded token by token). Measured on SmolLM2-135M with the
        exact cache: one newline before it works, two make the model miss; the trailing space
        (a token of its own, as in the needle's ``"is 12345"``) leaves only the digits to
        predict, where without it the model hesitates between ``" "`` and ``" a"`` (p(key)
        about 0.3 instead of 0.8, and a miss at 2048 tokens, depth 10%).
    answer_prefix : str, default ``""``
        Text expected between the question and the key; the teacher-forced score is that of
        the tokens of ``answer_prefix + key`` (``" "`` for a question without the trailing
        space).
    key_digits : int, default 5
        Keys are random integers of this many digits.
    key_format : callable, optional
        ``key_format(rng) -> str`` draws a key from the cell's ``numpy.random.Generator``
        instead (``key_digits`` is then unused).
    seed : int, default 0
        Keys come from ``numpy.random.default_rng([seed, length, round(depth * 1e6)])``: the same
        cell always gets the same key, different cells different ones.
    answer_tokens : int, default 8
        Greedy tokens generated after the question.
    align : {"sentence", "token"}, default "sentence"
        "sentence" moves the insertion point back to the nearest sentence end of the filler
        (a token ending in ``.``, ``!``, ``?`` or a newline; or the filler's start), "token"
        inserts at ``round(depth * haystack_tokens)`` exactly.
    """

    haystack: str = FILLER
    intro: str = INTRO
    needle: str = " The pass key is {key}. Remember it. "
    question: str = "\nWhat is the pass key? The pass key is "
    answer_prefix: str = ""
    key_digits: int = 5
    key_format: Callable[[Any], str] | None = None
    seed: int = 0
    answer_tokens: int = 8
    align: str = "sentence"

    def __post_init__(self) -> None:
        for name in ("haystack", "intro", "needle", "question", "answer_prefix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, received {type(getattr(self, name)).__name__}")
        if not self.haystack.strip():
            raise ValueError("haystack must hold some text")
        if "{key}" not in self.needle:
            raise ValueError(f"needle must contain '{{key}}', received {self.needle!r}")
        if not self.question:
            raise ValueError("question must not be empty")
        for name, low in (("key_digits", 1), ("answer_tokens", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, received {value!r}")
        if self.key_digits > 18:
            raise ValueError(f"key_digits must be at most 18, received {self.key_digits}")
        if self.key_format is not None and not callable(self.key_format):
            raise TypeError(f"key_format must be callable or None, received {type(self.key_format).__name__}")
        if self.align not in ("sentence", "token"):
            raise ValueError(f"align must be 'sentence' or 'token', received {self.align!r}")

    def key(self, length: int, depth: float) -> str:
        """The pass key of cell ``(length, depth)`` (deterministic in ``seed``).

        Parameters
        ----------
        length : int
            Prompt plus question tokens of the cell.
        depth : float
            Needle depth of the cell, in [0, 1].

        Returns
        -------
        str
            ``key_digits`` random digits, or what ``key_format`` draws.
        """
        import numpy as np

        rng = np.random.default_rng([self.seed, int(length), int(round(float(depth) * 1e6))])
        if self.key_format is not None:
            key = self.key_format(rng)
            if not isinstance(key, str) or not key:
                raise TypeError(f"key_format must return a non-empty str, returned {key!r}")
            return key
        return str(int(rng.integers(10 ** (self.key_digits - 1), 10**self.key_digits)))

    def haystack_text(self) -> str:
        """The filler text (the shipped book for ``haystack="book"``).

        Returns
        -------
        str
            :attr:`haystack`, or :func:`~arraykv.eval.builtin_long_text` for ``"book"``.
        """
        if self.haystack == "book":
            from .texts import builtin_long_text

            return builtin_long_text()
        return self.haystack

    def build(self, tokenizer: Any, length: int, depth: float, *, total: int | None = None) -> NeedlePrompt:
        """The token ids of cell ``(length, depth)``.

        Parameters
        ----------
        tokenizer : object
            Anything with ``encode`` and ``decode``, or a model whose ``tokenizer`` attribute has
            them.
        length : int
            Prompt plus question tokens.
        depth : float in [0, 1]
            Where the needle goes in the filler: 0 at its start, 1 at its end.
        total : int, optional
            Build ``total`` tokens instead of ``length`` (the key stays that of ``length``):
            :func:`needle_grid` shortens a cell at the model's context length by the answer's
            tokens so that the answer fits.

        Returns
        -------
        NeedlePrompt
            The prompt, question and target token ids, and where the needle went.
        """
        tok = getattr(tokenizer, "tokenizer", None) or tokenizer
        if not hasattr(tok, "encode") or not hasattr(tok, "decode"):
            raise TypeError(f"tokenizer must have encode and decode methods, received {type(tokenizer).__name__}")
        length = _check_length(length)
        depth = _check_depth(depth)
        key = self.key(length, depth)
        total = length if total is None else _check_length(total)
        # one BOS (where the tokenizer adds one) at the prompt's start, none inside it
        intro = _bos(tok) + (_plain_ids(tok, self.intro) if self.intro else [])
        needle = _plain_ids(tok, self.needle.format(key=key))
        question = _plain_ids(tok, self.question)
        target = _continuation(tok, self.question, self.answer_prefix + key)
        n_hay = total - len(intro) - len(needle) - len(question)
        if n_hay < 1:
            raise ValueError(
                f"length {total} leaves no room for filler: intro, needle and question take {total - n_hay} tokens"
            )
        hay = self._haystack_ids(tok, n_hay)
        at = int(round(depth * n_hay))
        if self.align == "sentence":
            at = _sentence_start(tok, hay, at)
        ids = intro + hay[:at] + needle + hay[at:]
        return NeedlePrompt(
            prompt_ids=ids,
            question_ids=question,
            target_ids=target,
            key=key,
            needle_start=len(intro) + at,
            needle_tokens=len(needle),
            haystack_tokens=n_hay,
            depth=depth,
        )

    def _haystack_ids(self, tok: Any, n: int) -> list:
        text = self.haystack_text().strip()
        sep = "\n" if "\n" in text else " "
        unit = len(_plain_ids(tok, text))
        reps = max(1, math.ceil(n / max(unit, 1))) + 1
        ids = _plain_ids(tok, sep.join([text] * reps))
        while len(ids) < n:  # a tokenizer that merges across the joins: add more
            reps *= 2
            ids = _plain_ids(tok, sep.join([text] * reps))
        return ids[:n]


def _plain_ids(tok: Any, text: str) -> list:
    """Token ids of ``text`` without the BOS token a tokenizer may put before every text."""
    try:
        return list(tok.encode(text, add_bos=False))
    except TypeError:  # a tokenizer without the option: drop a leading BOS
        ids = list(tok.encode(text))
        bos = getattr(tok, "bos_id", None)
        return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def _bos(tok: Any) -> list:
    """``[bos_id]`` when the tokenizer starts a text with its BOS token, else ``[]``."""
    ids, plain = list(tok.encode("a")), _plain_ids(tok, "a")
    return ids[: len(ids) - len(plain)]


def _continuation(tok: Any, context: str, text: str) -> list:
    """The ids of ``text`` as they follow ``context`` in one text (what the model is asked to
    produce after the context's tokens), or ``text``'s own ids where the two tokenizations
    part before the context ends."""
    ctx, joint = _plain_ids(tok, context), _plain_ids(tok, context + text)
    if joint[: len(ctx)] == ctx and len(joint) > len(ctx):
        return joint[len(ctx) :]
    return _plain_ids(tok, text)


def _sentence_start(tok: Any, hay: list, at: int) -> int:
    """The largest ``i <= at`` where ``hay[i - 1]`` ends a sentence, else 0 (the filler's start)."""
    seen: dict = {}
    for i in range(at, 0, -1):
        t = hay[i - 1]
        if t not in seen:
            seen[t] = tok.decode([t]).rstrip(" ").endswith(_SENTENCE_ENDS)
        if seen[t]:
            return i
    return 0


def _check_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an integer >= 2, received {length!r}")
    return length


def _check_depth(depth: Any) -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], received {depth!r}")
    return float(depth)


def needle_grid(
    model: Any,
    methods: Sequence[str],
    *,
    lengths: Sequence[int] = (2048, 4096, 8192),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    task: NeedleTask | None = None,
    chunk_size: int | None = 512,
    prefill_mode: str = "exact",
    cache_options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool = False,
    on_row: Callable[[NeedleRow], None] | None = None,
) -> NeedleResult:
    """Pass-key retrieval of each cache method over a grid of context lengths and needle depths.

    Parameters
    ----------
    model : DecoderModel
        With a tokenizer (:func:`arraykv.integrations.decoder.gguf_loading.load_model`).
    methods : sequence of str
        Names from :func:`arraykv.available_methods`. The exact cache is always run and
        reported as ``"dense"`` (first), whether listed or not.
    lengths : sequence of int, default (2048, 4096, 8192)
        Prompt plus question tokens, at most the model's context length. A length too close to
        it for the answer to follow is shortened so that the answer fits (8185 for 8192 with
        SmolLM2's 8192-token context and 8 answer tokens; :attr:`NeedleRow.tokens` holds it).
    depths : sequence of float in [0, 1], default (0.1, 0.5, 0.9)
        Where the needle goes in the filler: 0 at its start, 1 at its end
        (:meth:`NeedleTask.build`).
    task : NeedleTask, optional
        Texts, key and answer length; ``NeedleTask()`` by default.
    chunk_size : int or None, default 512
        Tokens per prefill chunk (an 8k prompt never builds an 8k x 8k score matrix).
    prefill_mode : {"exact", "cache", "cache-chunks"}, default "exact"
        How each method's cache receives the prompt (see the module docstring).
    cache_options : dict of str to dict, optional
        Extra ``make_cache`` options per method name (not for "dense").
    progress : bool, default False
        A tqdm progress bar (when tqdm is installed).
    on_row : callable, optional
        Called as ``on_row(row)`` with each :class:`NeedleRow` as soon as it is measured (a
        grid up to 8k or 32k tokens runs for an hour or more: a caller can report cells as they
        come, and keep them if the run is stopped).

    Returns
    -------
    NeedleResult
        One :class:`NeedleRow` per (length, depth, method), and summaries per method.

    Notes
    -----
    Cost: one chunked exact prefill per cell, plus per method one cache fill and
    ``len(question) + answer_tokens`` decode steps (again ``len(question) + len(target)`` when
    the greedy answer leaves the key's tokens, to score them teacher-forced).
    """
    task = NeedleTask() if task is None else task
    if not isinstance(task, NeedleTask):
        raise TypeError(f"task must be a NeedleTask, received {type(task).__name__}")
    methods, opts = check_common(model, methods, cache_options, chunk_size, prefill_mode)
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("model has no tokenizer; needle retrieval works on text")
    lengths = _check_seq("lengths", lengths, _check_length)
    depths = _check_seq("depths", depths, _check_depth)
    limit = model.config.context_length
    too_long = [n for n in lengths if n > limit]
    if too_long:
        raise ValueError(f"lengths {too_long} exceed the model's context length of {limit}")
    prompts = {}
    for n in lengths:
        for d in depths:
            p = task.build(model.tokenizer, n, d)
            room = max(task.answer_tokens, len(p.target_ids)) - 1  # decode steps after the question
            if n + room > limit:
                p = task.build(model.tokenizer, n, d, total=limit - room)
            prompts[n, d] = p
    record = prefill_mode == "exact" and len(methods) > 1
    bar = progress_bar(progress, len(prompts) * len(methods), "needle")
    rows = []
    try:
        for (n, d), p in prompts.items():
            exact = exact_prefill(model, p.prompt_ids, chunk_size=chunk_size, record=record)
            exact_hit = None
            for m in methods:
                if bar is not None:
                    bar.set_postfix_str(f"{m} @ {n}/{d:.0%}")
                mode = "exact" if m == "dense" else prefill_mode  # dense refills from the exact pass
                fresh = partial(method_cache, model, m, opts.get(m, {}), exact, p.prompt_ids, mode, chunk_size)
                cache = exact.cache if m == "dense" else fresh()
                row = _answer(model, task, p, m, n, cache, fresh, exact_hit)
                if m == "dense":
                    exact_hit = row.retrieved
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                del cache
                if bar is not None:
                    bar.update(1)
            del exact
    finally:
        if bar is not None:
            bar.close()
    return NeedleResult(
        rows=tuple(rows),
        methods=tuple(methods),
        lengths=tuple(lengths),
        depths=tuple(depths),
        prefill_mode=prefill_mode,
        task=task,
    )


def _check_seq(name: str, values: Any, check: Callable) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence, received {type(values).__name__}")
    values = list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    try:
        out = [check(v) for v in values]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if len(set(out)) != len(out):
        raise ValueError(f"{name} holds duplicates: {values}")
    return out


def _log_softmax(logits: Array) -> Array:
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    return z - math.log(float(np.exp(z).sum()))


def _answer(
    model: Any,
    task: NeedleTask,
    p: NeedlePrompt,
    method: str,
    length: int,
    cache: Any,
    fresh: Callable[[], Any],
    exact_hit: bool | None,
) -> NeedleRow:
    """Question, greedy answer and key score of one method in one cell."""
    import numpy as np

    from .. import _compat

    t0 = time.perf_counter()
    logits = None
    for t in p.question_ids:
        logits = model.decode(t, cache)
    bits, kv_bytes, tokens = bits_per_value(model, cache)
    target = p.target_ids
    eos = getattr(model.tokenizer, "eos_id", None)
    answer: list = []
    scores: list = []
    on_target = True  # every answer token so far equals the target's
    for i in range(task.answer_tokens):
        z = np.asarray(_compat.to_numpy(logits))
        if on_target and i < len(target):
            scores.append(float(_log_softmax(z)[target[i]]))
        tok = int(np.argmax(z))
        answer.append(tok)
        if i < len(target) and tok != target[i]:
            on_target = False
        if tok == eos or i == task.answer_tokens - 1:
            break
        logits = model.decode(tok, cache)
    if len(scores) < len(target) and on_target and answer[-1] != eos:
        # the answer stopped on the key's path before its end: continue it teacher-forced
        for j in range(len(scores), len(target)):
            z = model.decode(target[j - 1], cache)
            scores.append(float(_log_softmax(_compat.to_numpy(z))[target[j]]))
    elif len(scores) < len(target):
        # the greedy answer left the key's tokens: score them on a fresh cache holding the prompt
        again = fresh()
        for t in p.question_ids:
            z = model.decode(t, again)
        for j in range(len(target)):
            if j:
                z = model.decode(target[j - 1], again)
            if j >= len(scores):
                scores.append(float(_log_softmax(_compat.to_numpy(z))[target[j]]))
        del again
    text = model.tokenizer.decode([t for t in answer if t != eos])
    hit = p.key in text
    return NeedleRow(
        method=method,
        length=length,
        depth=p.depth,
        key=p.key,
        answer=text,
        retrieved=hit,
        exact_retrieved=hit if exact_hit is None else exact_hit,
        key_logprob=float(sum(scores)),
        bits_per_value=bits,
        kv_bytes=kv_bytes,
        tokens=tokens,
        needle_start=p.needle_start,
        seconds=time.perf_counter() - t0,
    )
