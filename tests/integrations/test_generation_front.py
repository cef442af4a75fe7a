"""The one ``generate`` of every engine: :class:`~arraykv.integrations.common.generation.GenerationFront`.

The three engines inherit it (one signature, one docstring, one set of checks); an engine of a
few lines over a real cache shows what the front owns itself: the argument checks, the empty
cache, the stop tokens (the tokenizer's when ``eos_id`` is None), the prefix-store switch and
leaving the cache empty when a generation fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv.integrations.common.generation import GenerationFront
from arraykv.integrations.decoder.model import DecoderModel
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder
from arraykv.integrations.onnxruntime.hook import OrtKVDecoder

VOCAB = 16


class Counting(GenerationFront):
    """Stores one zero key/value per token in layer 0 of a dense cache; the next token is the last + 1."""

    def __init__(self, tokenizer=None, fail_at=None):
        self.tokenizer = tokenizer
        self.fail_at = fail_at  # a token whose decode step raises after storing it
        self.stored_runs: list = []

    def make_cache(self, method="dense"):
        return arraykv.make_cache(method, num_layers=1, num_kv_heads=1, head_dim=4)

    def _cache_layers(self):
        return 1

    def _store(self, ids, cache):
        z = np.zeros((1, 1, len(ids), 4), np.float32)
        cache.prefill(0, z, z, z)

    def _logits(self, last):
        out = np.zeros(VOCAB, np.float32)
        out[(last + 1) % VOCAB] = 1.0
        return out

    def _prompt_logits(self, ids, cache, chunk):
        self._store(ids, cache)
        return self._logits(ids[-1])

    def _stored_prompt_logits(self, store, ids, cache, chunk):
        self.stored_runs.append(store)
        return self._prompt_logits(ids, cache, chunk)

    def _token_logits(self, token, cache):
        self._store([token], cache)
        if token == self.fail_at:
            raise RuntimeError("step failed")
        return self._logits(token)


class Tokenizer:
    eos_id = 5
    stop_ids = (4, 5)

    def encode(self, text):
        return [int(c) for c in text]


def test_every_engine_generates_through_the_one_front():
    for engine in (DecoderModel, OrtKVDecoder, OrtGraphDecoder):
        assert issubclass(engine, GenerationFront)
        assert engine.generate is GenerationFront.generate, engine.__name__


def test_the_front_runs_the_engine_steps_and_stops():
    eng = Counting()
    assert eng.generate([1, 2], 4) == [3, 4, 5, 6]
    assert eng.generate([1, 2], 4, eos_id=4) == [3, 4]
    assert eng.generate([1, 2], 4, eos_id=[9, 4]) == [3, 4]
    assert eng.generate([1, 2], 4, eos_id=4, stop_at_eos=False) == [3, 4, 5, 6]
    assert eng.generate(np.asarray([1, 2]), 0) == []
    seen: list = []
    assert eng.generate([7], 3, on_token=seen.append) == seen == [8, 9, 10]


def test_the_tokenizer_gives_text_prompts_and_the_default_stops():
    eng = Counting(Tokenizer())
    assert eng.generate("12", 6) == [3, 4]  # stop_ids: 4 ends it
    assert eng.generate("12", 6, eos_id=9) == [3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="no tokenizer"):
        Counting().generate("12", 2)


def test_the_front_checks_the_arguments_and_the_cache():
    eng = Counting()
    for bad in (dict(max_new_tokens=-1), dict(temperature=-1.0), dict(top_k=0), dict(prefill_chunk=0)):
        with pytest.raises(ValueError):
            eng.generate([1, 2], **bad)
    with pytest.raises(ValueError, match="at least one token"):
        eng.generate([], 2)
    cache = eng.make_cache()
    eng.generate([1], 1, cache=cache)
    with pytest.raises(ValueError, match="cache must be empty"):
        eng.generate([1], 1, cache=cache)
    with pytest.raises(TypeError, match="CompressedKVCache"):
        eng.generate([1], 1, cache=object())


def test_a_store_runs_the_prompt_through_the_engine_store_step():
    eng = Counting()
    store = object()
    assert eng.generate([1, 2], 2, store=store) == eng.generate([1, 2], 2)
    assert eng.stored_runs == [store]


def test_a_failed_generation_leaves_the_cache_empty():
    eng = Counting(fail_at=4)
    cache = eng.make_cache("int8")
    with pytest.raises(RuntimeError, match="step failed"):
        eng.generate([1, 2], 5, cache=cache)
    assert cache.seq_len(0) == 0
    assert Counting().generate([1, 2], 5, cache=cache) == [3, 4, 5, 6, 7]
