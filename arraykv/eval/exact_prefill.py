"""One exact prefill of a long prompt, shared by every cache method under test.

The prompt goes through the model once, in chunks, with the exact dense cache; a small
recording object sits between the model and that cache and keeps every layer's keys, values
and queries. Each method's cache is then filled with ONE ``cache.prefill(layer, K, V, Q)`` per
layer: the first prefill of a compressed cache stores the compressed form (fitting what it fits
on all prompt tokens, and seeing all prompt queries), and every method starts from the same
exact K/V. What is measured afterwards is what the compressed *storage* does to the following
decode steps.

``prefill_mode="cache"`` is the path users run: the prompt goes chunk by chunk through the
model's own prefill with the method's cache (:meth:`DecoderModel.prefill` with ``chunk_size``,
which keeps the prompt exact while it runs and stores it compressed at the end,
:mod:`arraykv.integrations.common.prompt_stage`). ``prefill_mode="cache-chunks"`` stores each chunk as
it comes (``prompt_store="chunks"``), so later chunks attend to the compressed earlier ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._types import Array
from ..protocol import KV_CACHE, supports
from .engine import ENGINE

__all__ = ["ExactPrefill", "exact_prefill", "PREFILL_MODES"]

#: How a method's cache receives the prompt: "exact" (one prefill per layer with the exact K/V/Q
#: of a dense chunked prefill), "cache" (the model's chunked prefill through the method's cache,
#: as users run it) or "cache-chunks" (the same, each chunk stored compressed as it comes).
PREFILL_MODES = ("exact", "cache", "cache-chunks")


class _Recorder:
    """Stands in for a cache during :meth:`DecoderModel.prefill`: forwards to ``cache``, keeps k, v, q.

    The model calls only ``prefill(layer, k, v, q)`` and ``seq_len(layer)``.
    """

    def __init__(self, cache: Any, num_layers: int):
        self.cache = cache
        self.chunks: list = [([], [], []) for _ in range(num_layers)]

    def prefill(self, layer: int, k: Array, v: Array, q: Array) -> Any:
        result = self.cache.prefill(layer, k, v, q)
        ks, vs, qs = self.chunks[layer]
        ks.append(k)
        # the model's v is a view into its fused QKV projection: copy it so that buffer can go
        vs.append(_compat.namespace(v).asarray(v, copy=True))
        qs.append(q)
        return result

    def seq_len(self, layer: int) -> int:
        n: int = self.cache.seq_len(layer)
        return n

    def joined(self) -> list[tuple[Array, ...]]:
        """Per layer ``(K, V, Q)`` with the chunks concatenated along the token axis; chunks dropped."""
        out = []
        for i, parts in enumerate(self.chunks):
            joined = []
            for arrays in parts:
                if len(arrays) == 1:
                    joined.append(arrays[0])
                else:
                    joined.append(_compat.namespace(arrays[0]).concat(arrays, axis=2))
            self.chunks[i] = ([], [], [])
            out.append(tuple(joined))
        return out


@dataclass(frozen=True)
class ExactPrefill:
    """A prompt run once through the model with the exact dense cache.

    Parameters
    ----------
    tokens : int
        Prompt length.
    cache : DenseCache
        The exact cache holding the prompt (the reference of every comparison; later decode
        steps through it change it).
    logits : numpy.ndarray, shape (vocab,), float32
        Logits of the last prompt position.
    layers : tuple of (k, v, q) or None
        Per layer the exact ``k``, ``v`` of shape ``(1, kv_heads, tokens, head_dim)`` and ``q``
        of shape ``(1, q_heads, tokens, head_dim)``, float32 (keys and queries after RoPE);
        None when not recorded.
    seconds : float
        Wall time of the prefill.
    """

    tokens: int
    cache: Any
    logits: Array
    layers: tuple | None
    seconds: float

    def fill(self, cache: Any) -> Any:
        """Store the prompt in the empty ``cache``: one ``cache.prefill(layer, K, V, Q)`` per layer.

        Parameters
        ----------
        cache : CompressedKVCache
            Empty, with the model's geometry.

        Returns
        -------
        CompressedKVCache
            ``cache`` itself, now holding :attr:`tokens` tokens.
        """
        if self.layers is None:
            raise ValueError("this exact prefill kept no K/V/Q; run exact_prefill with record=True")
        if not supports(cache, KV_CACHE):
            raise TypeError(f"cache must be a CompressedKVCache, received {type(cache).__name__}")
        if cache.seq_len(0) != 0:
            raise ValueError("cache must be empty; call cache.reset() first")
        for layer, (k, v, q) in enumerate(self.layers):
            cache.prefill(layer, k, v, q)
        return cache


def exact_prefill(model: Any, token_ids: Any, *, chunk_size: int | None = 512, record: bool = True) -> ExactPrefill:
    """Run ``token_ids`` through ``model`` with a dense cache in chunks, keeping every layer's K/V/Q.

    Parameters
    ----------
    model : DecoderModel
        Anything with ``make_cache``, ``prefill(ids, cache, chunk_size=, logits=)`` and ``config``.
    token_ids : sequence of int, length >= 1
        One prompt (batch 1), at most the model's context length.
    chunk_size : int or None, default 512
        Tokens per model prefill call (None: all at once); the result does not depend on it
        beyond float rounding.
    record : bool, default True
        Keep the K/V/Q for :meth:`ExactPrefill.fill` (about ``4 * tokens * layers * (2 *
        kv_heads + q_heads) * head_dim`` bytes: 0.9 GB at 8k tokens on SmolLM2-135M).

    Returns
    -------
    ExactPrefill
        The dense cache holding the prompt, the last position's logits, the wall time and,
        with ``record``, every layer's K/V/Q.
    """
    import numpy as np

    if not isinstance(record, bool):
        raise TypeError(f"record must be a bool, received {type(record).__name__}")
    ids = [int(i) for i in (_compat.to_numpy(token_ids).tolist() if hasattr(token_ids, "shape") else token_ids)]
    if not ids:
        raise ValueError("token_ids must hold at least one token")
    dense = model.make_cache("dense")
    target = _Recorder(dense, model.config.num_layers) if record else dense
    t0 = time.perf_counter()
    logits = model.prefill(ids, target, chunk_size=chunk_size, logits="last")
    seconds = time.perf_counter() - t0
    layers = tuple(target.joined()) if record else None
    return ExactPrefill(
        tokens=len(ids),
        cache=dense,
        logits=np.asarray(_compat.to_numpy(logits), dtype=np.float32),
        layers=layers,
        seconds=seconds,
    )


# -- shared by the long-context evaluations -------------------------------------------------
def check_common(
    model: Any,
    methods: Sequence[str],
    cache_options: Mapping[str, Mapping[str, Any]] | None,
    chunk_size: Any,
    prefill_mode: Any,
) -> tuple:
    """Validate the arguments every long-context evaluation takes.

    Returns
    -------
    (methods, options)
        ``methods``: ``["dense"]`` followed by the other requested methods in order (the exact
        cache is always reported, as "dense"); ``options``: dict of method to make_cache options.
    """
    from ..caches import available_methods

    if isinstance(methods, str):
        raise TypeError("methods must be a sequence of method names, not a single string")
    methods = list(methods)
    bad = [m for m in methods if not isinstance(m, str)]
    if bad:
        raise TypeError(f"methods must be method names (str), received {bad!r}")
    known = set(available_methods())
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; available: {', '.join(sorted(known))}")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise ValueError(f"methods lists {twice} more than once")
    opts = dict(cache_options or {})
    if "dense" in opts:
        raise ValueError("cache_options cannot name 'dense': it is the exact reference cache")
    stray = [m for m in opts if m not in methods]
    if stray:
        raise ValueError(f"cache_options names methods that are not evaluated: {stray}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None, received {chunk_size!r}")
    if not isinstance(prefill_mode, str) or prefill_mode not in PREFILL_MODES:
        raise ValueError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}, received {prefill_mode!r}")
    if not supports(model, ENGINE) or getattr(model, "config", None) is None:
        raise TypeError(f"model must be a DecoderModel (config, prefill, decode), received {type(model).__name__}")
    return ["dense"] + [m for m in methods if m != "dense"], opts


def method_cache(
    model: Any,
    method: str,
    options: Mapping[str, Any],
    exact: ExactPrefill,
    prompt: list,
    prefill_mode: str,
    chunk_size: int | None,
) -> Any:
    """A new cache of ``method`` holding ``prompt``, filled as ``prefill_mode`` says."""
    cache = model.make_cache(method, **dict(options))
    if prefill_mode == "exact" and exact.layers is not None:
        return exact.fill(cache)
    if prefill_mode == "cache-chunks":
        model.prefill(prompt, cache, chunk_size=chunk_size, logits="last", prompt_store="chunks")
    else:
        model.prefill(prompt, cache, chunk_size=chunk_size, logits="last")
    return cache


def stored_bytes(cache: Any) -> int:
    """Bytes of the stored tokens and fixed state: ``used_bytes()`` where the cache has it, else
    ``memory_usage()`` (a cache of the protocol only)."""
    used = getattr(cache, "used_bytes", None)
    return int(used() if callable(used) else cache.memory_usage())


def held_rows(cache: Any) -> int | None:
    """Token rows ``cache`` holds over all layers, where a layer holds fewer than its ``seq_len``
    (a hybrid cache's sliding windows); None for caches that hold every token."""
    held = getattr(cache, "held_tokens", None)
    n = getattr(cache, "num_layers", None)
    return sum(int(held(i)) for i in range(n)) if callable(held) and isinstance(n, int) else None


def bits_per_value(model: Any, cache: Any) -> tuple:
    """``(bits_per_value, kv_bytes, tokens)`` of ``cache`` now.

    ``bits_per_value = used_bytes() * 8 / (2 * layers * kv_heads * tokens * head_dim)``
    (:func:`stored_bytes`: the stored tokens and fixed state, not spare buffer capacity); for a
    hybrid cache the values are those held (a sliding layer holds its window, not ``tokens``).
    """
    c = model.config
    tokens = int(cache.seq_len(0))
    kv_bytes = stored_bytes(cache)
    rows = held_rows(cache)  # a hybrid cache: its sliding layers hold the window
    rows = c.num_layers * tokens if rows is None else rows
    values = 2 * c.num_kv_heads * rows * c.head_dim
    return (kv_bytes * 8.0 / values if values else 0.0), kv_bytes, tokens


def progress_bar(enabled: bool, total: int, label: str) -> Any:
    """A tqdm bar when ``enabled`` and tqdm is installed, else None."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="run", leave=False)
