"""Quality evaluation of KV-cache methods on a real model.

Teacher forcing on a short text (:mod:`.teacher_forced`)::

    evaluate(model, token_ids, methods, *, prefill=64, ...) -> list[EvalRow]
    teacher_forced(model, token_ids, cache=None, *, prefill=64) -> TeacherForced   # .logits

where ``model`` is a :class:`~arraykv.integrations.decoder.model.DecoderModel` or an
:class:`~arraykv.integrations.onnxruntime.OrtKVDecoder`, so two engines of one model compare in
three lines: ``a = teacher_forced(model, ids).logits``, ``b = teacher_forced(decoder,
ids).logits``, ``abs(a - b).max()``.

Long context, where compression matters (:mod:`.needle`, :mod:`.long_text`), both starting every
method from one exact chunked prefill of the prompt (:mod:`.exact_prefill`)::

    needle_grid(model, methods, *, lengths=(2048, 4096, 8192), depths=(0.1, 0.5, 0.9), ...) -> NeedleResult
    long_text_quality(model, methods, *, prefix_lengths=(3840, 7936), positions=256, ...) -> LongTextResult

and a picture of both (:func:`plot_long_context`, needs matplotlib). The shipped texts:
:func:`builtin_text` (*Pride and Prejudice* ch. 1-2, about 2,260 SmolLM2 tokens) and
:func:`builtin_long_text` (ch. 1-6, about 10,050 tokens).
"""

from __future__ import annotations

from .exact_prefill import PREFILL_MODES, ExactPrefill, exact_prefill
from .long_text import LongTextResult, long_text_quality
from .needle import FILLER, INTRO, NeedleTask, needle_grid
from .needle_result import NeedlePrompt, NeedleResult, NeedleRow, NeedleSummary
from .plot import plot_long_context
from .teacher_forced import *  # noqa: F403 - EvalRow, TeacherForced, teacher_forced, compare, evaluate, ...
from .teacher_forced import __all__ as _TEACHER_FORCED
from .texts import builtin_long_text, builtin_long_token_ids

__all__ = [
    # teacher forcing on a short text: the names of .teacher_forced
    *_TEACHER_FORCED,
    # long context
    "builtin_long_text",
    "builtin_long_token_ids",
    "ExactPrefill",
    "exact_prefill",
    "PREFILL_MODES",
    "NeedleTask",
    "NeedlePrompt",
    "NeedleRow",
    "NeedleSummary",
    "NeedleResult",
    "needle_grid",
    "FILLER",
    "INTRO",
    "LongTextResult",
    "long_text_quality",
    "plot_long_context",
]
