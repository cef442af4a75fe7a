"""A long prompt processed exactly, then stored compressed in one piece.

A prompt fed in chunks through a compressed cache attends, from its second chunk on, to the
*compressed* keys and values of the earlier chunks; the hidden states of every later prompt
token, in every layer, carry that error, and so do the keys and values stored for them. On
SmolLM2 after a 3,840-token prompt this is what separates pqo2's mean KL of 0.186 (chunks
stored one by one) from 0.037 (the prompt computed exactly, then stored).

:class:`PromptStage` stands in for the cache while a prompt's chunks run: the layers whose
cache compresses hold the prompt's keys and values exactly (float16, half of a float32 dense
cache) and hand them back for the next chunks' attention; the layers whose cache is exact
already (``dense``, sliding windows) write straight to it. When the last chunk is done,
:meth:`PromptStage.commit` stores each staged layer's whole prompt with one ``append`` call:
the cache then calibrates on, and encodes, the exact keys and values of the whole prompt.

Queries: a compressed cache takes the prompt's queries for its calibration (``pqo`` weighs key
channels by the queries' RMS per channel, which is all it reads of them). Holding every query
of a long prompt would cost more than its keys, so the stage keeps a uniform sample of at most
:data:`QUERY_SAMPLE` positions per layer and gives the cache that sample repeated to the
prompt's length, which leaves each channel's RMS that of the sample.

Sliding-window layers whose window is compressed (``storage="pq4"`` and the like) are staged
too, but only the rows their window will hold: the stage keeps the last ``window +
rollback_tokens`` positions (and the chunk in flight), hands them back as the window cache
would (the last positions, masked by the caller), and commits them with
:meth:`~arraykv.caches.window_cache.SlidingWindowCache.append_last`, which counts the whole
prompt's length.

Memory while a prompt runs: the float16 keys and values of the staged global layers (for
SmolLM2 at 8k tokens: 189 MB against the 377 MB of a float32 dense cache and the 49 MB pqo4
holds after) and at most a window and a chunk per staged sliding layer; it is freed by
:meth:`commit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ... import _compat
from ...protocol import (
    INCREMENTAL,
    LAYER_ROUTING,
    WINDOW_TAIL,
    CompressedKVCache,
    DequantResult,
    WindowTailKVCache,
    supports,
)

__all__ = ["PromptStage", "QUERY_SAMPLE", "stages_layer", "serving_cache"]

#: Query positions kept per layer for the cache's calibration.
QUERY_SAMPLE = 1024


def serving_cache(cache: CompressedKVCache, layer: int) -> CompressedKVCache:
    """The cache that serves ``layer`` (the part of a hybrid cache, or ``cache`` itself)."""
    return cache.cache_of(layer) if supports(cache, LAYER_ROUTING) else cache


def stages_layer(cache: CompressedKVCache, layer: int) -> bool:
    """Whether ``layer`` of ``cache`` compresses (so a prompt is staged for it)."""
    part = serving_cache(cache, layer)
    if not supports(part, INCREMENTAL):
        return False  # a cache of the protocol only: its chunks go straight to it
    return not getattr(part, "stores_exactly", False)


def _window_of(cache: CompressedKVCache, layer: int) -> WindowTailKVCache | None:
    """The window cache serving ``layer``, which takes a prompt by its last rows; None for another cache."""
    part = serving_cache(cache, layer)
    return part if supports(part, WINDOW_TAIL) else None


@dataclass
class _Staged:
    """One staged layer: the prompt's keys and values so far (float16), its query sample, its length."""

    k: Any
    v: Any
    queries: list[Any]
    seen: int


class PromptStage:
    """Stands in for ``cache`` while a prompt of ``total`` tokens runs in chunks.

    Parameters
    ----------
    cache : CompressedKVCache
        The target; it may hold earlier tokens (their K/V are read once per staged layer).
    num_layers : int
    total : int
        Prompt tokens that will arrive (to spread the query sample over them).
    """

    def __init__(self, cache: Any, num_layers: int, total: int):
        self.cache = cache
        self.total = int(total)
        self._staged = [stages_layer(cache, i) for i in range(num_layers)]
        #: The window cache of a staged sliding layer, which keeps its last ``keep`` rows between
        #: chunks (None: a global layer keeps all).
        self._windows = [_window_of(cache, i) if self._staged[i] else None for i in range(num_layers)]
        self._held: list[_Staged | None] = [None] * num_layers  # per staged layer: a _Staged once its first chunk came
        self._before: list[tuple[Any, Any] | None] = [None] * num_layers  # earlier tokens of the target, float (k, v)
        self._start: list[int] = [cache.seq_len(i) for i in range(num_layers)]

    # what the decoder calls -----------------------------------------------------------
    def seq_len(self, layer: int) -> int:
        if not self._staged[layer]:
            n: int = self.cache.seq_len(layer)
            return n
        held = self._held[layer]
        return self._start[layer] + (0 if held is None else held.seen)

    def prefill(self, layer: int, k: Any, v: Any, q: Any) -> DequantResult:
        if not self._staged[layer]:
            result: DequantResult = self.cache.prefill(layer, k, v, q)
            return result
        xp = _compat.namespace(k)
        held = self._held[layer]
        k16, v16 = xp.astype(k, xp.float16), xp.astype(v, xp.float16)
        if held is None:
            if self._start[layer]:
                r = self.cache.dequantize(layer)
                self._before[layer] = (xp.astype(r.k, k.dtype), xp.astype(r.v, v.dtype))
            held = self._held[layer] = _Staged(k16, v16, [], 0)
        else:
            held.k, held.v = xp.concat([held.k, k16], axis=2), xp.concat([held.v, v16], axis=2)
        t = int(k.shape[2])
        held.queries.append(self._sample(xp, q, held.seen))
        held.seen += t
        kk, vv = xp.astype(held.k, k.dtype), xp.astype(held.v, v.dtype)
        before = self._before[layer]
        if before is not None:
            kk, vv = xp.concat([before[0], kk], axis=2), xp.concat([before[1], vv], axis=2)
        # the chunk's own keys exactly as given (float32), the earlier ones through float16
        kk[:, :, -t:, :] = k
        vv[:, :, -t:, :] = v
        window = self._windows[layer]
        if window is not None:  # a sliding layer: only the rows its window will hold stay staged
            self._trim(layer, held, window.keep)
        return DequantResult(k=kk, v=vv)

    def _trim(self, layer: int, held: _Staged, keep: int) -> None:
        """Drop the staged (and earlier) rows of a sliding layer beyond its last ``keep``."""
        xp = _compat.namespace(held.k)
        before = self._before[layer]
        n_before = 0 if before is None else int(before[0].shape[2])
        n = int(held.k.shape[2])
        if n + n_before <= keep:
            return
        if n >= keep:
            held.k = xp.asarray(held.k[:, :, n - keep :, :], copy=True)
            held.v = xp.asarray(held.v[:, :, n - keep :, :], copy=True)
            self._before[layer] = None
        else:
            assert before is not None  # n < keep < n + n_before: there are earlier rows
            cut = n_before - (keep - n)
            self._before[layer] = (before[0][:, :, cut:, :], before[1][:, :, cut:, :])

    def _sample(self, xp: Any, q: Any, seen: int) -> Any:
        """The positions of ``q`` that fall on the uniform sample grid over the prompt."""
        step = max(1, math.ceil(self.total / QUERY_SAMPLE))
        first = (-seen) % step
        return xp.asarray(q[:, :, first::step, :], copy=True)

    # the end of the prompt ----------------------------------------------------------
    def commit(self) -> None:
        """Store every staged layer's prompt in the target, one ``append`` per layer; frees the stage."""
        for layer, held in enumerate(self._held):
            if held is None:
                continue
            xp = _compat.namespace(held.k)
            sample = xp.concat(held.queries, axis=2) if len(held.queries) > 1 else held.queries[0]
            k, v = xp.astype(held.k, sample.dtype), xp.astype(held.v, sample.dtype)
            reps = math.ceil(held.seen / max(1, int(sample.shape[2])))
            q = (xp.concat([sample] * reps, axis=2) if reps > 1 else sample)[:, :, : held.seen, :]
            self._held[layer] = None
            window = self._windows[layer]
            if window is None:
                self.cache.append(layer, k, v, q)
            else:  # the last rows of a sliding layer's prompt; its length counts every token
                rows = int(k.shape[2])
                window.append_last(layer, k, v, q[:, :, held.seen - rows :, :], held.seen)
