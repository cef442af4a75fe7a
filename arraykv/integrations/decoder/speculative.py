"""Speculative decoding over a compressed cache: a cheap draft proposes, the model verifies.

A draft (:mod:`arraykv.integrations.decoder.drafts`) proposes up to ``k`` tokens; the model (the
*target*) runs them in one multi-token pass, keeps the longest prefix of proposals that equal
its own greedy choices, adds its own token after it, and takes the rejected tokens back out of
its cache with ``truncate_all``. Every emitted token is the target's argmax, so the output is
the target's greedy decoding; what the draft buys is that the weights are read once for up to
``k`` tokens instead of once per token.

With ``concurrent=True`` the draft proposes the next block in one thread while the target
verifies the current one in another, assuming that every proposal is accepted (the block is
kept when that turns out true, truncated away otherwise). With a
:class:`~arraykv.integrations.decoder.drafts.LayerDraft` the two threads write different layers of one
cache object, which the contract's per-layer locks allow.

The verification pass (``verify="decode"``) runs the block layer by layer, each token alone
through the layer with the products of one-token decoding and stored with one
``cache.decode``: the target's hidden states, and so what it stores, are those of plain decoding
(up to the last bit of the fused kernels' sums, whose vectorized and scalar loop versions are
picked at run time by where buffers sit in memory), and only the output head (one product over
the block) rounds differently.
Batching the layers' products too (``verify="batched"``) reads each weight once for the block
but rounds differently from one-token decoding, and a quantizing cache turns a rounding
difference into a different code wherever a value sits on a level boundary: on SmolLM2 with
``int4`` that moved logits by up to 0.9 within 40 tokens. A ``cache.prefill`` of the block
(``verify="prefill"``) reads the cache once for all its tokens but shows a windowed cache's
queries a different window than one-token decoding; "auto" takes it for ``dense`` only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..common.generation import prompt_ids, stop_tokens, tokenizer_stops
from .drafts import Block, CacheDraft, LayerDraft, NgramDraft, argmax_rows, require_truncate, run_layers

__all__ = [
    "speculative_generate",
    "SpeculativeResult",
    "greedy_agreement",
    "greedy_with_gaps",
    "LayerDraft",
    "CacheDraft",
    "NgramDraft",
    "run_layers",
]

#: ``verify`` values: see :func:`arraykv.integrations.decoder.drafts.run_layers`; "auto" is "prefill" for
#: the ``dense`` cache and "decode" for every other.
VERIFY_MODES = ("auto", "decode", "batched", "prefill")


@dataclass(frozen=True)
class SpeculativeResult:
    """What :func:`speculative_generate` produced and how.

    Attributes
    ----------
    tokens : list of int
        New token ids (the prompt excluded), the target's greedy choices.
    drafted : int
        Proposals the draft made that the target checked.
    accepted : int
        Proposals equal to the target's choice.
    rounds : int
        Verification passes of the target.
    wasted : int
        Tokens drafted ahead in concurrent mode and thrown away.
    seconds : float
        Wall time after the prompt's prefill (the decoding itself).
    prefill_seconds : float
        Wall time of the prompt's prefill (target and draft).
    """

    tokens: list
    drafted: int
    accepted: int
    rounds: int
    wasted: int
    seconds: float
    prefill_seconds: float

    @property
    def acceptance_rate(self) -> float:
        """``accepted / drafted`` (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens after the first one, per second of decoding."""
        return (len(self.tokens) - 1) / self.seconds if self.seconds > 0 and len(self.tokens) > 1 else 0.0


def speculative_generate(
    model: Any,
    prompt: Any,
    max_new_tokens: int = 32,
    *,
    cache: Any,
    draft: Any,
    k: int = 4,
    eos_id: int | None = None,
    stop_at_eos: bool = True,
    concurrent: bool = False,
    verify: str = "auto",
    on_token: Callable[[int], None] | None = None,
    prefill_chunk: int | None = 512,
) -> SpeculativeResult:
    """Greedy generation of ``model`` through ``cache``, accelerated by a ``draft``.

    Parameters
    ----------
    model : DecoderModel
        The target.
    prompt : str or sequence of int
    max_new_tokens : int, default 32
    cache : cache
        An empty cache of the target (any method: it needs ``truncate_all``). Afterwards it
        holds the prompt and every new token but the last, as after :meth:`DecoderModel.generate`.
    draft : LayerDraft, CacheDraft or NgramDraft
    k : int, default 4
        Tokens per verification pass (the newest token and the proposals after it).
    eos_id : int, optional
        End-of-sequence token; None means the tokenizer's (the convention of
        :mod:`arraykv.integrations.common.generation`).
    stop_at_eos : bool, default True
        Stop right after the end-of-sequence token (the last item returned).
    concurrent : bool, default False
        Draft the next block in a second thread while the target verifies the current one
        (drafts that run a model).
    verify : {"auto", "decode", "batched", "prefill"}, default "auto"
        How the target runs and stores a block (module notes,
        :func:`~arraykv.integrations.decoder.drafts.run_layers`); "auto" is "prefill" for the ``dense``
        cache and "decode" otherwise.
    on_token : callable, optional
        Called with each new token id as it is produced.
    prefill_chunk : int or None, default 512
        Prompt chunking, as in :meth:`DecoderModel.generate`.

    Returns
    -------
    SpeculativeResult

    Notes
    -----
    With greedy verification the output is the target's greedy decoding (Leviathan et al.,
    2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al., 2023) up
    to float rounding between a one-row and a ``k``-row product in the output head (with
    ``verify="decode"``; every product with "batched"/"prefill"): a position where the
    target's two best logits are closer than that rounding may resolve differently.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, received {k!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, received {max_new_tokens!r}")
    if not isinstance(verify, str) or verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, received {verify!r}")
    if not all(hasattr(draft, a) for a in ("bind", "propose", "verify_input", "rollback")):
        raise TypeError(f"draft must be a LayerDraft, CacheDraft or NgramDraft, received {type(draft).__name__}")
    depth = 2 * k - 1 if concurrent else k - 1  # tokens stored past the shallowest cut
    require_truncate(cache, "cache", depth)
    ids = prompt_ids(prompt, model.tokenizer)
    if len(ids) + max_new_tokens + 2 * k > model.config.context_length:
        raise ValueError(
            f"the prompt ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) and 2k drafted "
            f"tokens exceed the context length of {model.config.context_length}"
        )
    if cache.seq_len(0) != 0:
        raise ValueError("cache must be empty; call cache.reset() first")
    draft.bind(model, cache, depth)
    if verify == "auto":
        verify = "prefill" if getattr(cache, "method", None) == "dense" else "decode"
    model._check_room(0, len(ids) + max_new_tokens + 2 * k)  # RoPE tables once, before any thread
    stops = stop_tokens(tokenizer_stops(model.tokenizer) if eos_id is None else eos_id, stop_at_eos)
    out: list = []
    if max_new_tokens == 0:
        return SpeculativeResult(out, 0, 0, 0, 0, 0.0, 0.0)
    t0 = time.perf_counter()
    logits = model.prefill(ids, draft.prompt_cache(cache), chunk_size=prefill_chunk, logits="last")
    draft.begin(ids)
    t1 = time.perf_counter()

    def emit(tok: int) -> bool:
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        return len(out) >= max_new_tokens or tok in stops

    drafted = accepted = rounds = wasted = 0
    done = emit(argmax_rows(logits[None, :])[0])
    block = None
    while not done:
        pos = len(ids) + len(out) - 1  # position of the newest token, not stored yet
        n = min(k, max_new_tokens - len(out))
        if block is None:
            block = draft.propose(out[-1], pos, n, ids + out)
        n = len(block.tokens)
        n_ahead = min(k, max_new_tokens - len(out) - n)
        if concurrent and n_ahead > 0 and len(block.proposals) == n:
            target, ahead = _verify_beside_draft(model, cache, draft, block, n_ahead, verify, ids + out)
        else:
            target, ahead = _verify(model, cache, draft, block, verify), None
        rounds += 1
        m = min(len(block.proposals), n)
        drafted += m
        a = 0
        while a < m and block.proposals[a] == target[a]:
            a += 1
        accepted += a
        for tok in target[: min(a + 1, n)]:
            if emit(tok):
                done = True
                break
        if a + 1 < n or (ahead is not None and a < n):  # stored tokens after the first rejection are void
            wasted += 0 if ahead is None else len(ahead.tokens)
            ahead = None
            if not done:
                cache.truncate_all(pos + a + 1)
                draft.rollback(pos + a + 1)
        block = ahead  # every proposal accepted: the block drafted meanwhile continues them
    # leave the caches as plain greedy decoding does: every new token but the last one stored
    final = len(ids) + len(out) - 1
    if cache.seq_len(0) > final:
        cache.truncate_all(final)
    draft.rollback(final)
    t2 = time.perf_counter()
    return SpeculativeResult(out, drafted, accepted, rounds, wasted, t2 - t1, t1 - t0)


def _verify(model: Any, cache: Any, draft: Any, block: Block, mode: str) -> list:
    """The target's greedy token after each of the block's tokens (one multi-token pass)."""
    x, layers = draft.verify_input(block)
    h = run_layers(model, x, cache, block.position, layers, mode=mode)
    return argmax_rows(model._logits(h)[0])


def _verify_beside_draft(
    model: Any, cache: Any, draft: Any, block: Block, n_ahead: int, mode: str, history: list
) -> tuple:
    """Verify ``block`` in a thread while drafting, here, the block after it (assuming all is accepted)."""
    box: dict = {}

    def work() -> None:
        try:
            box["target"] = _verify(model, cache, draft, block, mode)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    th = threading.Thread(target=work, name="arraykv-verify")
    th.start()
    try:
        nxt = block.proposals[-1]
        ahead = draft.propose(nxt, block.position + len(block.tokens), n_ahead, history + block.proposals)
    finally:
        th.join()
    if "error" in box:
        raise box["error"]
    return box["target"], ahead


def greedy_with_gaps(model: Any, prompt_ids: list, n: int, cache: Any) -> tuple:
    """Plain greedy decoding of ``n`` tokens through ``cache``, with the gap behind each choice.

    Returns
    -------
    tokens : list of int
    gaps : list of float
        For each token, its logit minus the second-best one (what :func:`greedy_agreement`
        forgives a difference at).
    seconds : float
        Decoding time after the prompt's prefill.
    """

    from ..._compat import to_numpy

    logits = model.prefill(prompt_ids, cache, chunk_size=512, logits="last")
    t0 = time.perf_counter()
    toks, gaps = [], []
    while True:
        row = to_numpy(logits)
        top = np.sort(row)[-2:]
        toks.append(int(np.argmax(row)))
        gaps.append(float(top[1] - top[0]))
        if len(toks) == n:
            return toks, gaps, time.perf_counter() - t0
        logits = model.decode(toks[-1], cache)


def greedy_agreement(reference: list, margins: list, candidate: list, *, tolerance: float = 1e-4) -> dict:
    """Compare a greedy output with a reference, forgiving a first difference at a near-tie.

    Parameters
    ----------
    reference : list of int
        Plain greedy tokens.
    margins : list of float
        For each reference token, the gap between the best and second-best logit that chose it.
    candidate : list of int
        Tokens to compare (e.g. a speculative run's).
    tolerance : float, default 1e-4
        Gaps below this count as float-rounding ties.

    Returns
    -------
    dict
        ``equal`` (identical), ``first_difference`` (index or None), ``margin`` (the
        reference's gap there), ``tie`` (the difference is at a gap below ``tolerance``) and
        ``ok`` (equal, or the first difference is a tie).
    """
    n = min(len(reference), len(candidate))
    first = next((i for i in range(n) if reference[i] != candidate[i]), None)
    if first is None and len(reference) != len(candidate):
        first = n
    margin = None if first is None or first >= len(margins) else float(margins[first])
    tie = margin is not None and margin < tolerance
    return {"equal": first is None, "first_difference": first, "margin": margin, "tie": tie, "ok": first is None or tie}
