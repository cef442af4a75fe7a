"""One generation front for every engine (:class:`~arraykv.integrations.decoder.model.DecoderModel`,
:class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder`,
:class:`~arraykv.integrations.onnxruntime.graph_decoder.OrtGraphDecoder`).

Each engine derives from :class:`GenerationFront` and so offers the one ``generate``::

    generate(prompt, max_new_tokens=32, *, cache=None, method="dense", eos_id=None,
             stop_at_eos=True, temperature=0.0, top_k=None, seed=None, on_token=None,
             prefill_chunk=512, store=None) -> list[int]

with the same meaning everywhere:

- ``prompt``: text (needs a tokenizer) or a sequence of token ids, for one sequence;
- ``cache``: an empty cache to fill, by default ``engine.make_cache(method)``;
- end of sequence: the token ``eos_id`` (or any of a collection of ids, such as a
  tokenizer's ``stop_ids``: Gemma ends a turn with ``<end_of_turn>`` and a text with
  ``<eos>``), or the engine's own when ``eos_id`` is None (the tokenizer's for a GGUF model; an
  ONNX decoder knows none). With ``stop_at_eos`` generation stops right after producing it,
  and the returned list ends with it;
- ``temperature`` 0 is greedy (arg-max), otherwise ``softmax(logits / temperature)`` sampled,
  among the ``top_k`` most likely tokens when given, seeded by ``seed``;
- the result is the list of new token ids (the prompt excluded).

This module holds the checks, the loop and :meth:`GenerationFront.generate`; an engine supplies
"logits of the prompt's last position" (with and without a prefix store) and "logits after one
more token".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np

from ..._compat import to_numpy
from ...protocol import INCREMENTAL, PREFILL_TARGET, TRANSACTIONS, TRUNCATION, supports

__all__ = [
    "GenerationFront",
    "cache_length",
    "undo_on_failure",
    "check_chunk",
    "prompt_ids",
    "check_sampling",
    "generate_tokens",
    "pick_token",
    "chunked_logits",
]


def cache_length(cache: Any, num_layers: int = 1) -> int:
    """Tokens ``cache`` holds; a ValueError when its first ``num_layers`` layers disagree.

    Layers run in sequence, so a step refused by layer ``i > 0`` (for example non-finite keys)
    may have stored its tokens in layers ``0 .. i-1``; such a cache is refused from then on
    instead of being grown further apart.

    Raises
    ------
    TypeError
        ``cache`` is not a CompressedKVCache.
    ValueError
        The layers hold different numbers of tokens.
    """
    if not supports(cache, PREFILL_TARGET):
        raise TypeError(f"cache must be a CompressedKVCache, received {type(cache).__name__}")
    lengths = [int(cache.seq_len(i)) for i in range(num_layers)]
    if any(n != lengths[0] for n in lengths):
        raise ValueError(
            f"the cache's layers hold different numbers of tokens ({lengths}), left so by a step "
            "that a later layer refused; call cache.reset() and run the prompt again"
        )
    return lengths[0]


def held_rewrites(cache: Any) -> int | None:
    """What a reader keeping a layer's K/V between calls checks besides ``seq_len``: the
    cache's :attr:`~arraykv.protocol.IncrementalKVCache.rewrites` (None for a cache without).

    A kept read is reused only while both are what they were when it was read; a cache
    truncated (or reset, restored, rolled back) and then extended again to the old length by
    someone else holds other tokens there. A cache without the count is trusted on its length.
    """
    return int(cache.rewrites) if supports(cache, INCREMENTAL) else None


@contextlib.contextmanager
def undo_on_failure(cache: Any, length: int) -> Iterator[None]:
    """Run a step that stores tokens after ``length`` all or nothing: if it raises, every layer
    of ``cache`` is left exactly as it was.

    Layers run in sequence, so a step that fails at layer ``i`` (non-finite keys, a full cache,
    ``MemoryError``, ``KeyboardInterrupt``) has already stored its tokens in layers ``0 ..
    i-1``. With a cache that offers transactions (:class:`~arraykv.protocol.TransactionalKVCache`,
    every arraykv cache) the step runs in one, and a failure puts every layer it changed back as it was, at any length
    (:meth:`arraykv.caches.LayeredCache.transaction`). A cache of the protocol only is truncated
    back to ``length`` with its ``truncate_all`` when it has one; when that is impossible, the
    step's exception gets a note saying so (and :func:`cache_length` refuses the cache later).
    The step's own exception is raised in every case.
    """
    if supports(cache, TRANSACTIONS):
        with cache.transaction():
            yield
        return
    try:
        yield
    except BaseException as exc:
        why = None
        if not supports(cache, TRUNCATION):
            why = "it has neither transaction() nor truncation (truncate_all())"
        else:
            try:
                cache.truncate_all(length)
            except Exception as undo:  # noqa: BLE001 - the step's own error is the one to report
                why = f"truncate_all({length}) failed: {undo}"
        if why is not None:
            _add_note(exc, f"arraykv: the cache may keep part of this step in some layers ({why})")
        raise


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11); before it, the ``__notes__`` list that it fills."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]  # BaseException declares it from 3.11 on
        notes.append(note)


def check_chunk(name: str, value: Any) -> None:
    """A ValueError naming ``name`` unless ``value`` is None or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, received {value!r}")


def prompt_ids(prompt: Any, tokenizer: Any) -> list[int]:
    """``prompt`` (str or sequence of int) as a non-empty list of int; text needs ``tokenizer``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass token ids as prompt instead of text")
        ids = list(tokenizer.encode(prompt))
    else:
        if hasattr(prompt, "shape") and len(prompt.shape) != 1:
            raise ValueError(f"prompt must be one sequence of token ids, received shape {tuple(prompt.shape)}")
        ids = [int(i) for i in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
    if not ids:
        raise ValueError("prompt must hold at least one token")
    return ids


def check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, prefill_chunk: Any) -> float:
    """Check the generation options; return ``temperature`` as a float."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, received {max_new_tokens!r}")
    value = float(temperature)
    if not value >= 0.0:
        raise ValueError(f"temperature must be >= 0, received {value}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, received {top_k!r}")
    check_chunk("prefill_chunk", prefill_chunk)
    return value


def chunked_logits(run: Callable[[Any], Any], ids: list[int], chunk: int | None) -> Any:
    """The logits of the last of ``run``'s calls over one sequence's ``ids`` fed in chunks.

    ``run`` takes an int64 array (1, t) of token ids; ``chunk`` tokens per call (None: one call).
    """

    a = np.asarray([ids], dtype=np.int64)
    step = a.shape[1] if chunk is None else chunk
    for s in range(0, a.shape[1], step):
        logits = run(a[:, s : s + step])
    return logits


def pick_token(logits: Any, temperature: float, top_k: int | None, rng: Any) -> int:
    """The next token from ``logits`` (NumPy, shape (vocab,)): arg-max at temperature 0, else sampled."""

    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        return int(np.argmax(z))
    z = z / temperature
    if top_k is not None and top_k < z.size:
        cut = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= cut, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


def stop_tokens(eos: int | Collection[int] | None, stop_at_eos: bool = True) -> frozenset[int]:
    """The tokens that end a generation: ``eos`` as one int or several (none when ``stop_at_eos``
    is False or ``eos`` is None)."""

    if not stop_at_eos or eos is None:
        return frozenset()
    return frozenset((int(eos),) if isinstance(eos, (int, np.integer)) else map(int, eos))


def tokenizer_stops(tokenizer: Any) -> Any:
    """The stop tokens of a tokenizer: its ``stop_ids`` (Gemma: ``<eos>`` and ``<end_of_turn>``),
    else its ``eos_id``; None without a tokenizer."""
    if tokenizer is None:
        return None
    return getattr(tokenizer, "stop_ids", None) or tokenizer.eos_id


def generate_tokens(
    prefill_last: Callable[[list[int]], Any],
    decode_last: Callable[[int], Any],
    ids: list[int],
    max_new_tokens: int,
    *,
    eos: int | Collection[int] | None,
    stop_at_eos: bool,
    temperature: float,
    top_k: int | None,
    seed: int | None,
    on_token: Callable[[int], None] | None,
) -> list[int]:
    """The generation loop shared by the engines.

    Parameters
    ----------
    prefill_last : callable
        ``prefill_last(ids)``: logits of the last prompt position, NumPy, shape (vocab,).
    decode_last : callable
        ``decode_last(token)``: logits after one more token, NumPy, shape (vocab,).
    ids : list of int
        The checked prompt.
    max_new_tokens : int
    eos : int, collection of int, or None
        The end-of-sequence token, or several that each end the sequence (None: never stop
        early).
    stop_at_eos : bool
    temperature, top_k, seed, on_token
        As in the module docstring.

    Returns
    -------
    list of int
        The new tokens, ending with ``eos`` (one of them) when generation stopped there.
    """

    stops = stop_tokens(eos, stop_at_eos)
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    rng = np.random.default_rng(seed)
    logits = prefill_last(ids)
    while True:
        tok = pick_token(logits, temperature, top_k, rng)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if len(out) >= max_new_tokens or tok in stops:
            return out
        logits = decode_last(tok)


class GenerationFront:
    """The ``generate`` every engine offers, over the steps the engine supplies.

    An engine derives from this class and defines ``make_cache(method)`` and the private
    steps below: the number of layers a cache of it has, the last prompt position's logits
    (with and without a prefix store) and the logits after one more token. The front checks the
    arguments, makes or checks the cache, picks the stop tokens, runs the loop of
    :func:`generate_tokens` and leaves the cache empty when a generation fails.

    Attributes
    ----------
    tokenizer : object or None
        The engine's tokenizer (``encode``, ``eos_id``, optionally ``stop_ids``): text prompts
        and the default stop tokens. None (an ONNX decoder): token ids only, no default stop.
    """

    tokenizer: Any = None

    # -- what an engine supplies ---------------------------------------------------------
    def make_cache(self, method: str = "dense") -> Any:
        """A cache of the engine's geometry; each engine defines its own (see there).

        Parameters
        ----------
        method : str, default "dense"
            The cache method.

        Returns
        -------
        CompressedKVCache
            An empty cache.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no make_cache")

    def _cache_layers(self) -> int:
        """The number of layers a cache of this engine has (all are checked to be empty)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how many layers its caches have")

    def _check_generation_room(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A ValueError when the engine cannot hold ``prompt_tokens + max_new_tokens`` tokens (no limit here)."""

    def _prompt_logits(self, ids: list[int], cache: Any, chunk: int | None) -> Any:
        """The logits (vocab,) of the prompt's last position, after storing ``ids`` in ``cache``."""
        raise NotImplementedError(f"{type(self).__name__} cannot run a prompt")

    def _stored_prompt_logits(self, store: Any, ids: list[int], cache: Any, chunk: int | None) -> Any:
        """:meth:`_prompt_logits` through the prefix store ``store``: stored prefixes restored, new ones stored."""
        raise NotImplementedError(f"{type(self).__name__} cannot use a prefix store")

    def _token_logits(self, token: int, cache: Any) -> Any:
        """The logits (vocab,) after storing one more ``token`` in ``cache``."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode")

    # -- the front -----------------------------------------------------------------------
    def generate(
        self,
        prompt: Any,
        max_new_tokens: int = 32,
        *,
        cache: Any = None,
        method: str = "dense",
        eos_id: int | Collection[int] | None = None,
        stop_at_eos: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        prefill_chunk: int | None = 512,
        store: Any = None,
    ) -> list[int]:
        """Greedy or sampled generation for one sequence.

        The convention every engine shares (:mod:`arraykv.integrations.common.generation`).

        Parameters
        ----------
        prompt : str or sequence of int
            Text (needs the engine's :attr:`tokenizer`; an ONNX decoder has none) or token ids.
        max_new_tokens : int, default 32
            The most tokens to generate (0: none, the prompt is not run).
        cache : CompressedKVCache, optional
            An empty cache of the engine's geometry; by default ``self.make_cache(method)``.
        method : str, default "dense"
            Cache method when ``cache`` is not given.
        eos_id : int or collection of int, optional
            The end-of-sequence token(s). None uses the engine's own: its tokenizer's
            ``stop_ids`` (else ``eos_id``); an engine without a tokenizer knows none, and
            generation runs for ``max_new_tokens``.
        stop_at_eos : bool, default True
            Stop right after producing an end-of-sequence token (it ends the returned list).
        temperature : float, default 0.0
            0 is greedy (argmax); otherwise sample from ``softmax(logits / temperature)``.
        top_k : int, optional
            Sample only among the ``top_k`` most likely tokens.
        seed : int, optional
            Seed of the sampler.
        on_token : callable, optional
            Called with each new token id as it is produced (for streaming output).
        prefill_chunk : int or None, default 512
            The prompt goes through the engine's prefill in chunks of this many tokens; None
            feeds it in one piece. :class:`~arraykv.integrations.decoder.model.DecoderModel`
            and :class:`~arraykv.integrations.onnxruntime.graph_decoder.OrtGraphDecoder`
            compute a prompt of several chunks over its exact keys and values and store it
            compressed at its end (``prompt_store="exact"``), with the output head on its last
            position only; :class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder` stores
            each chunk as it comes (:meth:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder.step`).
        store : PrefixStore, folder or ``redis://`` URL, optional
            Reuse the longest stored prefix of the prompt, prefill only the rest and store new
            prefixes; the result equals a run without a store bit for bit. A ``DecoderModel``
            runs the prompt in the store's segments (:class:`arraykv.store.PrefixStore`); the
            ONNX decoders go through :mod:`arraykv.integrations.onnxruntime.prefix_store` (an
            ``OrtKVDecoder`` built from a ready session needs the store's ``model_id``; for an
            ``OrtGraphDecoder`` the store's ``chunk_tokens`` must be a multiple of
            ``prefill_chunk``).

        Returns
        -------
        list of int
            The new token ids (the prompt excluded).

        Raises
        ------
        ValueError
            A bad argument, text without a tokenizer, a cache that is not empty, or (a
            ``DecoderModel``) a prompt and ``max_new_tokens`` beyond the context length.
        TypeError
            ``cache`` is not a CompressedKVCache.
        """
        ids = prompt_ids(prompt, self.tokenizer)
        temperature = check_sampling(max_new_tokens, temperature, top_k, prefill_chunk)
        self._check_generation_room(len(ids), max_new_tokens)
        if cache is None:
            cache = self.make_cache(method)
        elif cache_length(cache, self._cache_layers()) != 0:
            raise ValueError("cache must be empty; call cache.reset() first")
        if eos_id is None:  # every stop token of the model (Gemma: two)
            eos_id = tokenizer_stops(self.tokenizer)

        def prompt_last(p: list[int]) -> Any:
            if store is None:
                return to_numpy(self._prompt_logits(p, cache, prefill_chunk))
            return to_numpy(self._stored_prompt_logits(store, p, cache, prefill_chunk))

        with undo_on_failure(cache, 0):  # a failed generation leaves the cache empty, as it came
            return generate_tokens(
                prompt_last,
                lambda tok: to_numpy(self._token_logits(tok, cache)),
                ids,
                max_new_tokens,
                eos=eos_id,
                stop_at_eos=stop_at_eos,
                temperature=temperature,
                top_k=top_k,
                seed=seed,
                on_token=on_token,
            )
