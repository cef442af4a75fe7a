"""generate_with_store: ArraykvCache inside transformers' generate, with a prefix store (skipped
when torch or transformers is absent).

The contract: a run that restores a stored prefix gives the tokens and every array of
``cache.arraykv_cache`` of the same call finding no entry (the cold run, which stores it); a
restored cache's rollback copies are the last of the cold run's. On a tiny random Llama
(as tests/integrations/test_transformers.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from arraykv.integrations.transformers import ArraykvCache, generate_with_store  # noqa: E402
from arraykv.integrations.transformers.prefix_store import transformers_identity  # noqa: E402
from arraykv.store import LocalStore, PrefixStore  # noqa: E402

from cache_contract import assert_same_state  # noqa: E402
from tiny_models import hf_gemma3, hf_ids, hf_llama  # noqa: E402

S = 16  # tokens per stored segment


@pytest.fixture(scope="module")
def tiny():
    return hf_llama(0)


def _run(model, ids, method, store, new=6, **cache_kwargs):
    cache = ArraykvCache(method, config=model.config, model=model, **cache_kwargs)
    try:
        out = generate_with_store(
            model,
            ids,
            cache,
            store,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    finally:
        cache.detach()
    return out, cache


@pytest.mark.parametrize("method", ["pqo4", "int4", "dense"])
def test_continuing_a_stored_prefix_equals_the_cold_run(tiny, tmp_path, method):
    for n in (3 * S + 5, 2 * S + 1):  # longest stored prefix 1 segment back; the whole prompt but its last token
        folder = tmp_path / f"{method}-{n}"
        ids = hf_ids(1, n)
        store = PrefixStore(LocalStore(folder), chunk_tokens=S, policy="every")
        cold_out, cold = _run(tiny, ids, method, store)
        stored = list(range(S, n, S))
        assert store.last_report.reused == 0 and store.last_report.stored == stored
        assert cold_out.shape == (1, n + 6) and torch.equal(cold_out[:, :n], ids)

        # a store with nothing in it gives the same (the cold run is the run without an entry)
        empty_out, empty = _run(tiny, ids, method, PrefixStore(LocalStore(tmp_path / "empty"), chunk_tokens=S))
        assert torch.equal(empty_out, cold_out)
        assert_same_state(empty.arraykv_cache, cold.arraykv_cache)

        for back in (1, 2):  # the longest stored prefix 1 and 2 segments back
            warm_store = PrefixStore(LocalStore(tmp_path / f"{method}-{n}-{back}"), chunk_tokens=S, policy="every")
            keep = stored[-back] if len(stored) >= back else None
            if keep is None:
                continue
            _run(tiny, ids[:, : keep + 1], method, warm_store)  # stores prefixes up to `keep`
            assert warm_store.last_report.stored[-1] == keep
            warm_out, warm = _run(tiny, ids, method, warm_store)
            assert warm_store.last_report.reused == keep, (n, back)
            assert torch.equal(warm_out, cold_out)
            assert_same_state(warm.arraykv_cache, cold.arraykv_cache, restored=True)

        again_out, again = _run(tiny, ids, method, store)  # everything stored: the prompt's n - 1 tokens back
        assert store.last_report.reused == stored[-1] and store.last_report.stored == []
        assert torch.equal(again_out, cold_out)
        assert_same_state(again.arraykv_cache, cold.arraykv_cache, restored=True)


def test_a_hybrid_model_continues_the_same(tmp_path):
    """Sliding-window and global layers (a HybridCache): a tiny random Gemma 3."""
    model = hf_gemma3(0)
    ids = hf_ids(1, 3 * S + 5)
    store = PrefixStore(LocalStore(tmp_path / "cold"), chunk_tokens=S, policy="every")
    cold_out, cold = _run(model, ids, "pqo4", store)
    assert type(cold.arraykv_cache).__name__ == "HybridCache" and store.last_report.stored == [S, 2 * S, 3 * S]
    warm_store = PrefixStore(LocalStore(tmp_path / "warm"), chunk_tokens=S, policy="every")
    _run(model, ids[:, : S + 1], "pqo4", warm_store)
    warm_out, warm = _run(model, ids, "pqo4", warm_store)
    assert warm_store.last_report.reused == S
    assert torch.equal(warm_out, cold_out)
    assert_same_state(warm.arraykv_cache, cold.arraykv_cache, restored=True)


def test_the_cache_after_the_prompt_holds_what_a_forward_per_segment_gives(tiny, tmp_path):
    ids = hf_ids(1, 2 * S + 3)
    ref = ArraykvCache("int4", config=tiny.config)
    with torch.no_grad():
        for s in range(0, 2 * S + 2, S):
            e = min(s + S, 2 * S + 2)
            tiny(input_ids=ids[:, s:e], cache=ref, use_cache=True)
        ref_logits = tiny(input_ids=ids[:, -1:], cache=ref).logits
    cache = ArraykvCache("int4", config=tiny.config)
    out = generate_with_store(
        tiny, ids, cache, PrefixStore(LocalStore(tmp_path), chunk_tokens=S), max_new_tokens=1, do_sample=False
    )
    assert int(out[0, -1]) == int(ref_logits[0, -1].argmax())
    assert cache.get_seq_length() == 2 * S + 3


def test_a_model_with_other_weights_does_not_find_the_entry(tiny, tmp_path):
    ids = hf_ids(1, 2 * S + 4)
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S, policy="every")
    _run(tiny, ids, "int4", store)
    assert store.last_report.stored == [S, 2 * S]
    other = hf_llama(7)
    assert transformers_identity(other) != transformers_identity(tiny)
    assert transformers_identity(tiny) == transformers_identity(hf_llama(0))
    _run(other, ids, "int4", store)
    assert store.last_report.reused == 0
    _run(tiny, ids, "int4", store)
    assert store.last_report.reused == 2 * S
    named = PrefixStore(LocalStore(tmp_path), chunk_tokens=S, model_id="tiny-llama")
    _run(tiny, ids, "int4", named)  # another name, another namespace
    assert named.last_report.reused == 0 and named.last_report.stored == [2 * S]


def test_a_one_token_prompt_goes_straight_to_generate(tiny, tmp_path):
    out, cache = _run(tiny, hf_ids(1, 1), "int4", PrefixStore(LocalStore(tmp_path), chunk_tokens=S), new=3)
    assert out.shape == (1, 4) and cache.get_seq_length() == 3


def test_bad_arguments_are_refused(tiny, tmp_path):
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    ids = hf_ids(1, 2 * S)
    with pytest.raises(TypeError, match="ArraykvCache"):
        generate_with_store(tiny, ids, transformers.DynamicCache(config=tiny.config), store)
    with pytest.raises(ValueError, match="batch 1"):
        generate_with_store(tiny, torch.cat([ids, ids]), ArraykvCache("int4", config=tiny.config), store)
    with pytest.raises(ValueError, match="incremental"):
        generate_with_store(tiny, ids, ArraykvCache("int4", config=tiny.config, incremental=True), store)
    with pytest.raises(TypeError, match="integer"):
        generate_with_store(tiny, ids.float(), ArraykvCache("int4", config=tiny.config), store)
    with pytest.raises(ValueError, match="at least one"):
        generate_with_store(tiny, ids[:, :0], ArraykvCache("int4", config=tiny.config), store)
    full = ArraykvCache("int4", config=tiny.config)
    with torch.no_grad():
        tiny(input_ids=ids[:, :3], cache=full)
    with pytest.raises(ValueError, match="empty"):
        generate_with_store(tiny, ids, full, store)
    cache = ArraykvCache("int4", config=tiny.config)
    with pytest.raises(ValueError, match="cache argument"):
        generate_with_store(tiny, ids, cache, store, past_key_values=cache)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding"):
        generate_with_store(tiny, ids, cache, store, attention_mask=mask)
    with pytest.raises(TypeError, match="transformers model"):
        transformers_identity(object())
    assert cache.get_seq_length() == 0
