"""Files of real caches pass the load checks: SmolLM2-135M after a 512-token prompt (slow).

The checks on loading (:mod:`arraykv.caches.restore_checks`) refuse states that leave no
float16 room for the next token; a cache of a real model must never be one of them. Each
cache is saved, loaded (every check run), and the loaded cache continues exactly as the one
that was saved.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraykv

from smollm import smollm_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return smollm_or_skip()


@pytest.mark.parametrize("method", ["pqo4", "int4", "lowrank", "tq3"])
def test_a_real_cache_after_a_512_token_prompt_saves_and_loads(model, method, tmp_path):
    ids = np.random.default_rng(0).integers(100, 40000, size=512)
    cache = model.make_cache(method)
    logits = model.prefill(ids, cache)
    path = tmp_path / f"{method}.akv"
    cache.save(path)
    loaded = arraykv.load(path)
    token = int(np.argmax(np.asarray(logits)[-1] if np.asarray(logits).ndim > 1 else logits))
    want = np.asarray(model.decode(token, cache))
    got = np.asarray(model.decode(token, loaded))
    assert np.isfinite(got).all() and np.array_equal(got, want)
