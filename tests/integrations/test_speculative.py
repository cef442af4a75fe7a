"""Speculative decoding: the output is the target's greedy decoding, the cache ends as plain decoding leaves it."""

from __future__ import annotations

import numpy as np
import pytest

from arraykv.integrations.decoder.drafts import NgramDraft, run_layers
from arraykv.integrations.decoder.model import DecoderModel, random_gguf_tensors
from arraykv.integrations.decoder.speculative import (
    CacheDraft,
    LayerDraft,
    greedy_agreement,
    greedy_with_gaps,
    speculative_generate,
)

from tiny_models import SPECULATIVE_LLAMA as CFG

METHODS = ["dense", "pqo4", "pq3", "tq3", "int4", "int2"]


@pytest.fixture(scope="module")
def model():
    # an untied random head and stronger attention keep greedy output from settling on one token
    t = random_gguf_tensors(CFG, seed=3)
    rng = np.random.default_rng(1)
    t["output.weight"] = rng.standard_normal((CFG.vocab_size, CFG.hidden_size)).astype(np.float32)
    for i in range(CFG.num_layers):
        t[f"blk.{i}.attn_output.weight"] *= 3
    return DecoderModel.from_gguf_tensors(CFG, t)


@pytest.fixture(scope="module")
def prompt():
    return [int(i) for i in np.random.default_rng(7).integers(0, CFG.vocab_size, 40)]


def plain_greedy(model, prompt, n, cache):
    """Greedy tokens through ``cache`` and the gap between the two best logits at each choice."""
    return greedy_with_gaps(model, prompt, n, cache)[:2]


class WrongDraft(LayerDraft):
    """A layer draft whose every third proposal is deliberately wrong (forces rejections)."""

    def step(self, token, position):
        p, h = super().step(token, position)
        return ((p + 1) % CFG.vocab_size if position % 3 == 0 else p), h


def _same_cache(a, b, layers):
    for layer in range(layers):
        assert a.seq_len(layer) == b.seq_len(layer)
        if a.method != "dense":  # verify="decode": the arrays plain decoding stores
            la, lb = a.layer_arrays(layer), b.layer_arrays(layer)
            assert la.keys() == lb.keys()
            for name in la:
                x, y = np.asarray(la[name]), np.asarray(lb[name])
                assert x.shape == y.shape and x.dtype == y.dtype, name
                if np.issubdtype(x.dtype, np.floating):
                    # the fused kernels' vectorized loops round in an order that can depend on where
                    # their buffers sit in memory (see docs/speculative.md): the last bit may differ
                    # float16 copies: one step of float16; small entries: the rounding of sums whose
                    # terms are of the array's scale (keys are x @ Wk over hidden states of order 1)
                    eps = float(np.finfo(x.dtype).eps)
                    scale = float(np.abs(y).max()) if y.size else 1.0
                    np.testing.assert_allclose(x, y, rtol=max(1e-5, 2 * eps), atol=1e-5 * scale, err_msg=name)
                else:  # codes: equal unless such a last-bit difference met a level boundary
                    assert np.count_nonzero(x != y) <= max(2, x.size // 500), name
        ra, rb = a.dequantize(layer), b.dequantize(layer)
        np.testing.assert_allclose(np.asarray(ra.k), np.asarray(rb.k), rtol=0, atol=2e-3)
        np.testing.assert_allclose(np.asarray(ra.v), np.asarray(rb.v), rtol=0, atol=2e-3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("draft", ["layers1", "layers3", "wrong", "cache", "ngram"])
@pytest.mark.parametrize("concurrent", [False, True])
def test_output_is_plain_greedy_and_cache_ends_the_same(model, prompt, method, draft, concurrent):
    n = 30
    ref_cache = model.make_cache(method)
    ref, gaps = plain_greedy(model, prompt, n, ref_cache)
    d = {
        "layers1": LayerDraft(1),
        "layers3": LayerDraft(3),
        "wrong": WrongDraft(2),
        "cache": CacheDraft("pqo2"),
        "ngram": NgramDraft(),
    }[draft]
    cache = model.make_cache(method)
    r = speculative_generate(model, prompt, n, cache=cache, draft=d, k=4, concurrent=concurrent, stop_at_eos=False)
    verdict = greedy_agreement(ref, gaps, r.tokens)
    assert verdict["ok"], verdict
    assert len(r.tokens) == n
    assert r.drafted >= r.accepted >= 0 and r.rounds >= 1
    if draft == "wrong":
        assert r.accepted < r.drafted
    if verdict["equal"]:
        _same_cache(cache, ref_cache, CFG.num_layers)


@pytest.mark.parametrize("k", [1, 2, 7])
def test_any_block_size_and_short_budgets(model, prompt, k):
    for n in (1, 2, 5, 11):
        ref, gaps = plain_greedy(model, prompt, n, model.make_cache("pqo4"))
        cache = model.make_cache("pqo4")
        r = speculative_generate(model, prompt, n, cache=cache, draft=WrongDraft(2), k=k, stop_at_eos=False)
        assert greedy_agreement(ref, gaps, r.tokens)["ok"]
        assert len(r.tokens) == n
        assert cache.seq_len(0) == len(prompt) + n - 1
        assert r.drafted <= r.rounds * k and r.rounds <= n


@pytest.mark.parametrize("verify", ["decode", "batched", "prefill"])
def test_dense_verifies_by_decode_or_prefill_alike(model, prompt, verify):
    ref, gaps = plain_greedy(model, prompt, 20, model.make_cache("dense"))
    r = speculative_generate(
        model, prompt, 20, cache=model.make_cache("dense"), draft=WrongDraft(2), k=5, verify=verify, stop_at_eos=False
    )
    assert greedy_agreement(ref, gaps, r.tokens)["ok"]


def test_ngram_draft_copies_what_followed_the_latest_match():
    d = NgramDraft(max_ngram=2)
    hist = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    b = d.propose(3, 11, 4, hist)
    assert b.proposals == [5, 6, 1] and b.tokens == [3, 5, 6, 1]
    assert d.propose(8, 3, 4, [7, 7, 8]).proposals == []
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDraft(max_ngram=1, min_ngram=2)


def test_ngram_draft_accepts_on_repeating_text(model):
    rep = [3, 14, 15, 92, 65, 35, 89, 79] * 4
    ref, gaps = plain_greedy(model, rep, 24, model.make_cache("pqo4"))
    r = speculative_generate(model, rep, 24, cache=model.make_cache("pqo4"), draft=NgramDraft(), k=5, stop_at_eos=False)
    assert greedy_agreement(ref, gaps, r.tokens)["ok"]
    assert r.rounds < 24


def test_zero_tokens_leaves_cache_empty(model, prompt):
    cache = model.make_cache("dense")
    r = speculative_generate(model, prompt, 0, cache=cache, draft=LayerDraft(2))
    assert r.tokens == [] and cache.seq_len(0) == 0


@pytest.mark.parametrize("method", ["int4", "pqo4"])
def test_decode_mode_stores_what_one_token_decoding_stores(model, prompt, method):
    a, b = model.make_cache(method), model.make_cache(method)
    model.prefill(prompt, a)
    model.prefill(prompt, b)
    nxt = [5, 17, 33, 2, 90, 41]
    for t in nxt:
        model.decode(t, a)
    run_layers(model, model._embed(model._ids([nxt])[0]), b, len(prompt), range(CFG.num_layers), mode="decode")
    _same_cache(b, a, CFG.num_layers)
    with pytest.raises(ValueError, match="mode must be"):
        run_layers(model, model._embed(model._ids([nxt])[0]), b, len(prompt), range(1), mode="rows")


def test_run_layers_equals_one_token_decoding(model, prompt):
    a, b = model.make_cache("pqo4"), model.make_cache("pqo4")
    model.prefill(prompt, a)
    model.prefill(prompt, b)
    nxt = [5, 17, 33]
    for t in nxt:
        want = model.decode(t, a)
    ids, _ = model._ids([nxt])
    h = run_layers(model, model._embed(ids), b, len(prompt), range(CFG.num_layers))
    got = np.asarray(model._logits(h))[0, -1]
    np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=1e-4)
    _same_cache(a, b, CFG.num_layers)


def test_bad_arguments(model, prompt):
    cache = model.make_cache("dense")
    with pytest.raises(ValueError, match="k must"):
        speculative_generate(model, prompt, 4, cache=cache, draft=LayerDraft(2), k=0)
    with pytest.raises(ValueError, match="layers must be below"):
        speculative_generate(model, prompt, 4, cache=cache, draft=LayerDraft(CFG.num_layers))
    with pytest.raises(ValueError, match="layers must be a positive"):
        LayerDraft(0)
    with pytest.raises(TypeError, match="draft must be"):
        speculative_generate(model, prompt, 4, cache=cache, draft="pqo2")
    with pytest.raises(ValueError, match="cache of its own"):
        speculative_generate(model, prompt, 4, cache=cache, draft=CacheDraft(cache=cache))
    with pytest.raises(TypeError, match="truncate_all"):
        speculative_generate(model, prompt, 4, cache=object(), draft=LayerDraft(2))
    with pytest.raises(ValueError, match="rollback_tokens=3 or more"):
        speculative_generate(model, prompt, 4, cache=model.make_cache("pqo4", rollback_tokens=2), draft=LayerDraft(2))
    with pytest.raises(ValueError, match="rollback_tokens=7 or more"):
        speculative_generate(
            model,
            prompt,
            4,
            cache=model.make_cache("int4", rollback_tokens=6),
            draft=LayerDraft(2),
            k=4,
            concurrent=True,
        )
    with pytest.raises(ValueError, match="draft's cache keeps"):
        speculative_generate(
            model, prompt, 4, cache=model.make_cache("dense"), draft=CacheDraft("pqo2", rollback_tokens=1)
        )
    model.prefill(prompt, cache)
    with pytest.raises(ValueError, match="must be empty"):
        speculative_generate(model, prompt, 4, cache=cache, draft=LayerDraft(2))


def test_greedy_agreement_forgives_only_ties():
    assert greedy_agreement([1, 2, 3], [1.0, 1.0, 1.0], [1, 2, 3])["equal"]
    v = greedy_agreement([1, 2, 3], [1.0, 1e-6, 1.0], [1, 4, 5])
    assert v["ok"] and v["tie"] and v["first_difference"] == 1
    assert not greedy_agreement([1, 2, 3], [1.0, 0.5, 1.0], [1, 4, 5])["ok"]
    assert not greedy_agreement([1, 2, 3], [1.0, 1.0, 1.0], [1, 2])["ok"]


@pytest.mark.parametrize("method", ["pqo4", "tq3", "int4", "lowrank"])
def test_short_prompt_calibrating_inside_a_block(model, method):
    """A prompt shorter than the window: the layer calibrates in a verified block and is cut back before it."""
    short = [int(i) for i in np.random.default_rng(11).integers(0, CFG.vocab_size, 10)]
    ref, gaps = plain_greedy(model, short, 40, model.make_cache(method))
    cache = model.make_cache(method)
    r = speculative_generate(model, short, 40, cache=cache, draft=WrongDraft(2), k=6, stop_at_eos=False)
    assert greedy_agreement(ref, gaps, r.tokens)["ok"]
    assert r.accepted < r.drafted
