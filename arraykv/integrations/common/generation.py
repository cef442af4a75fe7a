"""One generation convention for every engine (:class:`~arraykv.integrations.decoder.model.DecoderModel`,
:class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder`).

Both engines offer::

    generate(prompt, max_new_tokens=32, *, cache=None, method="dense", eos_id=None,
             stop_at_eos=True, temperature=0.0, top_k=None, seed=None, on_token=None,
             prefill_chunk=512) -> list[int]

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

This module holds the checks and the loop; an engine supplies "logits of the prompt's last
position" and "logits after one more token".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np

__all__ = [
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
    if not hasattr(cache, "seq_len") or not hasattr(cache, "prefill"):
        raise TypeError(f"cache must be a CompressedKVCache, received {type(cache).__name__}")
    lengths = [int(cache.seq_len(i)) for i in range(num_layers)]
    if any(n != lengths[0] for n in lengths):
        raise ValueError(
            f"the cache's layers hold different numbers of tokens ({lengths}), left so by a step "
            "that a later layer refused; call cache.reset() and run the prompt again"
        )
    return lengths[0]


@contextlib.contextmanager
def undo_on_failure(cache: Any, length: int) -> Iterator[None]:
    """Run a step that stores tokens after ``length`` all or nothing: if it raises, every layer
    of ``cache`` is left exactly as it was.

    Layers run in sequence, so a step that fails at layer ``i`` (non-finite keys, a full cache,
    ``MemoryError``, ``KeyboardInterrupt``) has already stored its tokens in layers ``0 ..
    i-1``. With a cache that offers ``transaction()`` (every arraykv cache) the step runs in
    one, and a failure puts every layer it changed back as it was, at any length
    (:meth:`arraykv.caches.LayeredCache.transaction`). A cache of the protocol only is truncated
    back to ``length`` with its ``truncate_all`` when it has one; when that is impossible, the
    step's exception gets a note saying so (and :func:`cache_length` refuses the cache later).
    The step's own exception is raised in every case.
    """
    transaction = getattr(cache, "transaction", None)
    if callable(transaction):
        with transaction():
            yield
        return
    try:
        yield
    except BaseException as exc:
        truncate_all = getattr(cache, "truncate_all", None)
        why = None if callable(truncate_all) else "it has neither transaction() nor truncate_all()"
        if why is None:
            try:
                truncate_all(length)
            except Exception as undo:  # noqa: BLE001 - the step's own error is the one to report
                why = f"truncate_all({length}) failed: {undo}"
        if why is not None:
            exc.add_note(f"arraykv: the cache may keep part of this step in some layers ({why})")
        raise


def check_chunk(name: str, value: Any) -> None:
    """A ValueError naming ``name`` unless ``value`` is None or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, received {value!r}")


def prompt_ids(prompt: Any, tokenizer: Any) -> list:
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
    temperature = float(temperature)
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, received {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, received {top_k!r}")
    check_chunk("prefill_chunk", prefill_chunk)
    return temperature


def chunked_logits(run: Callable[[Any], Any], ids: list, chunk: int | None) -> Any:
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


def stop_tokens(eos: int | Collection[int] | None, stop_at_eos: bool = True) -> frozenset:
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
    prefill_last: Callable[[list], Any],
    decode_last: Callable[[int], Any],
    ids: list,
    max_new_tokens: int,
    *,
    eos: int | Collection[int] | None,
    stop_at_eos: bool,
    temperature: float,
    top_k: int | None,
    seed: int | None,
    on_token: Callable[[int], None] | None,
) -> list:
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
    out: list = []
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
