"""Drafts for speculative decoding: who proposes the tokens the model then verifies.

A draft is bound to the target model and its cache, takes the prompt, proposes a block of
tokens after a given one, and is told when the target kept fewer of them than it stored.

:class:`LayerDraft`
    Self-speculation: the model's first layers and its output head, on the target's own cache.
:class:`CacheDraft`
    The whole model (or another with the same vocabulary) over a cache of its own.
:class:`NgramDraft`
    Copies what followed the latest earlier occurrence of the newest tokens (prompt lookup):
    no model at all, so it costs nothing and pays where text repeats itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ... import _compat
from ...protocol import SNAPSHOTS, TRUNCATION, DequantResult, supports

__all__ = [
    "Block",
    "LayerDraft",
    "CacheDraft",
    "NgramDraft",
    "draft_from_spec",
    "run_layers",
    "RUN_MODES",
    "argmax_rows",
    "require_truncate",
]


#: How :func:`run_layers` stores a block (see there).
RUN_MODES = ("decode", "batched", "prefill")


def run_layers(model: Any, x: Any, cache: Any, start: int, layers: range, *, mode: str = "decode") -> Any:
    """Run hidden states through some of ``model``'s layers, storing their K/V in ``cache``.

    Parameters
    ----------
    model : DecoderModel
    x : array, shape (batch, t, hidden), float32
        Hidden states entering ``layers[0]`` for positions ``start .. start + t - 1``.
    cache : CompressedKVCache
        Holds ``start`` tokens in each of ``layers``.
    start : int
        Position of the first token.
    layers : range
        Consecutive layer indices.
    mode : {"decode", "batched", "prefill"}, default "decode"
        "decode": layer by layer, each token alone through the layer (the products of
        one-token decoding, bit for bit) and into the cache with one ``cache.decode``, in
        order; the block's tokens share the layer's weights while they are in the CPU's
        caches. "batched": the same cache calls, with the layer's products over all ``t``
        tokens at once (one weight read, but other float rounding than one-token decoding:
        a quantizing cache can then store a different code where a value sits on a level
        boundary, and the difference grows through the layers). "prefill": products over
        the block and one ``cache.prefill`` per layer, attending causally over what it
        returns: the same attention as one-token decoding only for a cache without a window
        or pending groups (``dense``).

    Returns
    -------
    array, shape (batch, t, hidden), float32
        Hidden states leaving ``layers[-1]``.
    """
    if mode not in RUN_MODES:
        raise ValueError(f"mode must be one of {', '.join(RUN_MODES)}, received {mode!r}")
    t = int(x.shape[1])
    if mode == "decode" and t > 1:
        rows = [x[:, j : j + 1, :] for j in range(t)]
        for i in layers:
            rows = [model.decode_layer(i, r, cache, start + j) for j, r in enumerate(rows)]
        return model._ops.concat(rows, axis=1)
    step = model.prefill_layer if mode == "prefill" else model.decode_layer
    for i in layers:
        x = step(i, x, cache, start)
    return x


def argmax_rows(logits: Any) -> list:
    """Greedy token of each row of ``logits`` (rows, vocab) as Python ints."""
    return [int(i) for i in _compat.to_numpy(logits).argmax(axis=-1)]


def require_truncate(cache: Any, what: str, depth: int = 0) -> None:
    """Refuse a cache that cannot take back ``depth`` tokens: one without truncation
    (:data:`~arraykv.protocol.TRUNCATION`, ``TypeError``), or with a ``rollback_tokens`` margin
    below ``depth`` (``ValueError`` naming the fix)."""
    if not supports(cache, TRUNCATION):
        raise TypeError(f"{what} must support truncate_all (every arraykv cache does), received {type(cache).__name__}")
    margin = cache.get_config().get("rollback_tokens") if supports(cache, SNAPSHOTS) else None
    if isinstance(margin, int) and margin < depth:
        raise ValueError(
            f"{what} keeps rollback copies of {margin} tokens, but this k may take back {depth}: "
            f"make it with rollback_tokens={depth} or more, or use a smaller k"
        )


@dataclass
class Block:
    """A drafted block, stored in the draft's layers (if any) at ``position ..``.

    Attributes
    ----------
    position : int
        Position of ``tokens[0]``, the newest token of the sequence (not in the target's cache yet).
    tokens : list of int
        What the target stores and verifies: the newest token, then proposals.
    proposals : list of int
        ``proposals[j]`` is the draft's guess of the token after ``tokens[j]``; as long as
        ``tokens`` (the last guess is not stored) or one shorter (every guess is stored).
    carries : list
        Per stored token, what the target continues from (hidden states), or empty.
    """

    position: int
    tokens: list[int]
    proposals: list[int] = field(default_factory=list)
    carries: list[Any] = field(default_factory=list)


class _StepDraft:
    """A draft that proposes one token per step, storing the one before it."""

    shares_cache = False

    def step(self, token: int, position: int) -> tuple[int, Any]:
        """Store ``token`` at ``position``; return (proposal, what the target continues from, or None)."""
        raise NotImplementedError

    def propose(self, token: int, position: int, n: int, history: list) -> Block:
        """Store ``token`` and ``n - 1`` of its own proposals after it; ``n`` proposals in all."""
        b = Block(position, [token])
        for j in range(n):
            p, c = self.step(b.tokens[-1], position + j)
            b.proposals.append(p)
            if c is not None:
                b.carries.append(c)
            if j < n - 1:
                b.tokens.append(p)
        return b


class LayerDraft(_StepDraft):
    """Self-speculation: the model's first ``layers`` layers, its final norm and output head.

    Parameters
    ----------
    layers : int
        Layers the draft runs, ``1 <= layers < num_layers``.

    Notes
    -----
    The draft stores each token in layers ``0 .. layers-1`` of the target's cache with the
    same one-token decode the target runs, so the target does not run those layers again: it
    continues from the hidden state the draft computed (early-exit self-speculation, as in
    Elhoushi et al., 2024, "LayerSkip", here on an unmodified model). Its proposals are only
    as good as the model's intermediate layers predict its output; on SmolLM2-135M that is
    poor (``docs/speculative.md``).
    """

    shares_cache = True

    def __init__(self, layers: int):
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive integer, received {layers!r}")
        self.layers = layers
        #: The target and its cache, once bound.
        self.model: Any = None
        self.cache: Any = None

    def bind(self, model: Any, cache: Any, depth: int = 0) -> None:
        """Attach to the target ``model`` and its ``cache``."""
        n = model.config.num_layers
        if self.layers >= n:
            raise ValueError(f"layers must be below the model's {n} layers, received {self.layers}")
        self.model, self.cache = model, cache

    def prompt_cache(self, cache: Any) -> Any:
        """The cache the target's prompt prefill goes through: its own (it fills the draft's layers)."""
        return cache

    def begin(self, prompt_ids: list) -> None:
        """Nothing to do after the prompt."""

    def step(self, token: int, position: int) -> tuple[int, Any]:
        """Store ``token`` at ``position`` in the draft's layers; return (proposal, hidden state)."""
        m = self.model
        ids, _ = m._ids([[token]])
        h = run_layers(m, m._embed(ids), self.cache, position, range(self.layers))
        return argmax_rows(m._logits(h)[:, 0, :])[0], h

    def verify_input(self, block: Block) -> tuple:
        """Hidden states entering the first target-only layer, and the layers the target runs."""
        xp = self.model._ops
        c = block.carries[: len(block.tokens)]
        return (c[0] if len(c) == 1 else xp.concat(c, axis=1)), range(self.layers, self.model.config.num_layers)

    def rollback(self, length: int) -> None:
        """Nothing of its own: its layers are truncated with the target's cache."""

    def __repr__(self) -> str:
        return f"LayerDraft(layers={self.layers})"


class _Tee:
    """The target's cache for a prompt prefill that also hands every layer's K/V/Q to a second cache."""

    def __init__(self, cache: Any, other: Any):
        self.cache, self.other = cache, other

    def seq_len(self, layer: int) -> int:
        n: int = self.cache.seq_len(layer)
        return n

    def prefill(self, layer: int, k: Any, v: Any, q: Any) -> DequantResult:
        self.other.append(layer, k, v, q)
        result: DequantResult = self.cache.prefill(layer, k, v, q)
        return result


class CacheDraft(_StepDraft):
    """The whole model (or another one with the same vocabulary) over a cache of its own.

    Parameters
    ----------
    method : str, default "pqo2"
        Cache method of the draft (ignored when ``cache`` is given).
    model : DecoderModel, optional
        The draft model; by default the target itself.
    cache : cache, optional
        An empty cache for the draft; by default ``model.make_cache(method, **options)``.
    **options
        Options of the draft cache.

    Notes
    -----
    When the draft is the target model itself, the prompt is not run twice: the target's
    prefill hands each layer's keys, values and queries to the draft's cache as well
    (``append``), so the draft holds the compressed form of the exact prompt K/V.
    """

    def __init__(self, method: str = "pqo2", *, model: Any = None, cache: Any = None, **options: Any):
        self.method = method if cache is None else getattr(cache, "method", type(cache).__name__)
        self.options = options
        self._model, self._cache = model, cache
        #: The draft model, its cache and the target, once bound.
        self.model: Any = None
        self.cache: Any = None
        self.target: Any = None

    def bind(self, model: Any, cache: Any, depth: int = 0) -> None:
        """Attach to the target ``model``; build or check the draft's cache.

        ``depth`` is how many tokens the draft may have to take back.
        """
        draft = self._model if self._model is not None else model
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                f"target's ({model.config.vocab_size})"
            )
        own = self._cache if self._cache is not None else draft.make_cache(self.method, **self.options)
        if own is cache:
            raise ValueError("a CacheDraft needs a cache of its own; use LayerDraft to share the target's cache")
        require_truncate(own, "the draft's cache", depth)
        if own.seq_len(0) != 0:
            raise ValueError("the draft's cache must be empty; call reset() first")
        self.model, self.cache, self.target = draft, own, model

    def prompt_cache(self, cache: Any) -> Any:
        """What the target's prompt prefill goes through: a tee into the draft's cache when the models are one."""
        return _Tee(cache, self.cache) if self.model is self.target else cache

    def begin(self, prompt_ids: list) -> None:
        """Prefill the draft's cache with the prompt, unless the tee already did."""
        if self.cache.seq_len(0) == 0:
            self.model.prefill(prompt_ids, self.cache, chunk_size=512, logits="last")

    def step(self, token: int, position: int) -> tuple[int, Any]:
        """Decode ``token`` (at ``position``) with the draft; return (proposal, None)."""
        return argmax_rows(self.model.decode([token], self.cache)[None, :])[0], None

    def verify_input(self, block: Block) -> tuple:
        """The target's embeddings of the block's tokens, and all of its layers."""
        t = self.target
        ids, _ = t._ids([block.tokens])
        return t._embed(ids), range(t.config.num_layers)

    def rollback(self, length: int) -> None:
        """Truncate the draft's cache to ``length`` tokens."""
        if self.cache.seq_len(0) > length:
            self.cache.truncate_all(length)

    def __repr__(self) -> str:
        return f"CacheDraft(method={self.method!r})"


class NgramDraft:
    """Prompt lookup: propose what followed the latest earlier occurrence of the newest tokens.

    Parameters
    ----------
    max_ngram : int, default 3
        Longest suffix of the sequence looked up.
    min_ngram : int, default 1
        Shortest suffix that counts as a match; with none, the block holds no proposal and
        the target decodes one token.

    Notes
    -----
    No model runs, so a rejected proposal costs only the target's extra rows in one pass.
    It pays where the output repeats the prompt or itself (quoting, editing, code, lists), as
    in prompt-lookup decoding (Saxena, 2023) and the n-gram drafts of "REST" (He et al., 2023).
    """

    shares_cache = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        for name, val in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, received {val!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.target: Any = None

    def bind(self, model: Any, cache: Any, depth: int = 0) -> None:
        """Attach to the target ``model``."""
        self.target = model

    def prompt_cache(self, cache: Any) -> Any:
        """The target's own cache (nothing to fill)."""
        return cache

    def begin(self, prompt_ids: list) -> None:
        """Nothing to do after the prompt."""

    def propose(self, token: int, position: int, n: int, history: list) -> Block:
        """Up to ``n - 1`` proposals after ``token`` (the last item of ``history``), all stored."""
        b = Block(position, [token])
        m = len(history)
        for size in range(min(self.max_ngram, m - 1), self.min_ngram - 1, -1):
            tail = history[m - size :]
            for s in range(m - size - 1, -1, -1):  # latest earlier occurrence first
                if history[s : s + size] == tail:
                    follow = history[s + size : s + size + n - 1]
                    b.proposals.extend(follow)
                    b.tokens.extend(follow)
                    return b
        return b

    def verify_input(self, block: Block) -> tuple:
        """The target's embeddings of the block's tokens, and all of its layers."""
        t = self.target
        ids, _ = t._ids([block.tokens])
        return t._embed(ids), range(t.config.num_layers)

    def rollback(self, length: int) -> None:
        """Nothing to roll back."""

    def __repr__(self) -> str:
        return f"NgramDraft(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


def draft_from_spec(spec: str) -> Any:
    """A draft from a short text: ``layers:N``, ``cache:METHOD`` or ``ngram[:N]`` (N = longest n-gram).

    For command lines and benchmarks. Raises ``ValueError`` for anything else.
    """
    kind, _, arg = str(spec).partition(":")
    try:
        if kind == "layers":
            return LayerDraft(int(arg))
        if kind == "cache":
            return CacheDraft(arg or "pqo2")
        if kind == "ngram":
            return NgramDraft(int(arg or 3))
    except ValueError as exc:
        raise ValueError(f"bad draft {spec!r}: {exc}") from None
    raise ValueError(f"a draft is layers:N, cache:METHOD or ngram[:N], received {spec!r}")
