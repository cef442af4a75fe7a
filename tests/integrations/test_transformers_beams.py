"""Decoding modes of transformers' generate that move batch rows: beam search (``reorder_cache``),
``num_return_sequences``, and the cache methods ``batch_repeat_interleave`` / ``batch_select_indices``
(skipped without torch or transformers).

``ArraykvCache("dense")`` must give exactly the tokens (and logits) of transformers' own
``DynamicCache``, with and without the model given (fused decode or not), on the tiny random
Llama and the tiny hybrid Gemma 3 (sliding-window layers); the compressed methods must run.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from arraykv.integrations.transformers import ArraykvCache  # noqa: E402

from tiny_models import HF_MODELS, hf_ids  # noqa: E402


@pytest.fixture(scope="module", params=list(HF_MODELS))
def model(request):
    return HF_MODELS[request.param]()


def _dynamic(m):
    return transformers.DynamicCache(config=m.config)


def _caches(m, method: str = "dense"):
    """The ArraykvCache variants: without the model, and with it (hooked queries, fused decode)."""
    return {
        "plain": lambda: ArraykvCache(method, config=m.config),
        "model": lambda: ArraykvCache(method, config=m.config, model=m),
    }


def _beams(m, cache, ids, mask=None, **kw):
    with torch.no_grad():
        out = m.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=10,
            min_new_tokens=10,
            num_beams=3,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            **kw,
        )
    if hasattr(cache, "detach"):
        cache.detach()
    return out


@pytest.mark.parametrize("variant", ["plain", "model"])
def test_beam_search_gives_the_dynamic_caches_tokens(model, variant):
    ids = hf_ids(1, 14, seed=7, low=1)
    want = _beams(model, _dynamic(model), ids, num_return_sequences=3)
    got = _beams(model, _caches(model)[variant](), ids, num_return_sequences=3)
    assert torch.equal(got, want)


def test_beam_search_of_a_padded_batch(model):
    ids = hf_ids(2, 16, seed=8, low=1)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    want = _beams(model, _dynamic(model), ids, mask)
    for make in _caches(model).values():
        assert torch.equal(_beams(model, make(), ids, mask), want)


@pytest.mark.parametrize("method", ["pqo4", "int4"])
def test_beam_search_runs_on_compressed_caches(model, method):
    ids = hf_ids(1, 30, seed=9, low=1)
    for make in _caches(model, method).values():
        cache = make()
        out = _beams(model, cache, ids)
        assert out.shape == (1, 40)
        assert cache.arraykv_cache.batch_size() == 3  # the beams' rows, reordered every step
        assert all(cache.get_seq_length(i) == 39 for i in range(model.config.num_hidden_layers))


@pytest.mark.parametrize("variant", ["plain", "model"])
def test_sampled_sequences_per_prompt_are_the_dynamic_caches(model, variant):
    ids = hf_ids(2, 12, seed=10, low=1)

    def run(cache):
        torch.manual_seed(123)
        with torch.no_grad():
            return model.generate(
                ids, cache=cache, max_new_tokens=8, do_sample=True, num_return_sequences=2, top_k=20, pad_token_id=0
            )

    want = run(_dynamic(model))
    cache = _caches(model)[variant]()
    assert torch.equal(run(cache), want)
    cache.detach()


def _next_logits(m, cache, ids):
    with torch.no_grad():
        return m(ids, cache=cache).logits


@pytest.mark.parametrize("variant", ["plain", "model"])
def test_repeat_select_and_reorder_after_a_prefill_match_the_dynamic_cache(model, variant):
    """The cache methods themselves, between forwards: the logits of later steps are the same as
    DynamicCache's after the same batch moves (expansion after prefill, selection, reordering)."""
    prompt = hf_ids(2, 18, seed=11, low=1)
    moves = [
        ("batch_repeat_interleave", 2),  # 2 -> 4 rows
        ("reorder_cache", torch.tensor([3, 3, 0, 1])),
        ("batch_select_indices", torch.tensor([2, 0])),
    ]
    runs = []
    for cache in (_dynamic(model), _caches(model)[variant]()):
        logits = [_next_logits(model, cache, prompt)]
        batch = 2
        for j, (name, arg) in enumerate(moves):
            getattr(cache, name)(arg)
            batch = 2 * batch if name == "batch_repeat_interleave" else len(arg)
            logits.append(_next_logits(model, cache, hf_ids(batch, 1, seed=20 + j, low=1)))
            logits.append(_next_logits(model, cache, hf_ids(batch, 1, seed=30 + j, low=1)))
        runs.append(logits)
        if hasattr(cache, "detach"):
            cache.detach()
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got, want)


def test_incremental_pasts_follow_their_rows(model):
    ids = hf_ids(3, 20, seed=12, low=1)
    inc = ArraykvCache("int4", config=model.config, incremental=True)
    ref = ArraykvCache("int4", config=model.config)
    for cache in (inc, ref):
        _next_logits(model, cache, ids)
        _next_logits(model, cache, ids[:, :1])
        cache.reorder_cache(torch.tensor([2, 2, 1]))
    for step in range(3):
        nxt = hf_ids(3, 1, seed=40 + step, low=1)
        torch.testing.assert_close(_next_logits(model, inc, nxt), _next_logits(model, ref, nxt), rtol=0, atol=1e-5)


def test_moving_rows_is_checked_and_one_layer_alone_is_refused(model):
    cache = ArraykvCache("pqo4", config=model.config, model=model)
    cache.reorder_cache(torch.tensor([0, 0]))  # empty: nothing to move
    _next_logits(model, cache, hf_ids(2, 10, low=1))
    before = [cache.arraykv_cache.layer_arrays(i) for i in range(model.config.num_hidden_layers)]
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="integer"):
        cache.batch_select_indices(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(0)
    with pytest.raises(NotImplementedError, match="on the cache, not on one layer"):
        cache.layers[0].reorder_cache(torch.tensor([1, 0]))
    after = [cache.arraykv_cache.layer_arrays(i) for i in range(model.config.num_hidden_layers)]
    for b, a in zip(before, after):
        assert b.keys() == a.keys() and all((b[n] == a[n]).all() for n in b)
    cache.detach()
