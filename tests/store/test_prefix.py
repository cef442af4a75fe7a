"""A stored prefix continued equals a fresh run of the same schedule, bit for bit."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from arraykv.store import (
    EntryError,
    LocalStore,
    PrefixStore,
    StoreWarning,
    encode_cache,
    restore_entry,
    segmented_prefill,
)
from arraykv.store.binding import seal_entry
from arraykv.store.entry import ROLLBACK_ARRAYS

from cache_contract import assert_same_state
from tiny_models import store_prompt

S, CHUNK = 64, 32  # tokens per stored segment, the decoder's prefill chunk within a segment


def decode_steps(model, cache, logits, steps=3) -> list:
    out = []
    for _ in range(steps):
        logits = model.decode(int(np.argmax(logits)), cache)
        out.append(np.asarray(logits))
    return out


@pytest.mark.parametrize("method", ["pqo4", "int4", "dense", "pqo2"])
def test_continuing_a_stored_prefix_equals_a_fresh_run(model, tmp_path, method):
    ids = store_prompt(3 * S + 17)
    ref = model.make_cache(method)
    ref_logits = segmented_prefill(model, ids, ref, chunk_tokens=S, chunk_size=CHUNK)
    ref_steps = decode_steps(model, ref, ref_logits)

    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S, policy="every")
    cold = model.make_cache(method)
    cold_logits = store.prefill(model, ids, cold, chunk_size=CHUNK)
    assert store.last_report.reused == 0 and store.last_report.stored == [S, 2 * S, 3 * S]
    assert np.array_equal(cold_logits, ref_logits)

    for cut in (3 * S + 17, 2 * S + 5, S + 1):  # prompts whose longest stored prefix is 3, 2, 1 segments
        fresh = model.make_cache(method)
        want = segmented_prefill(model, ids[:cut], fresh, chunk_tokens=S, chunk_size=CHUNK)
        warm = model.make_cache(method)
        got = store.prefill(model, ids[:cut], warm, chunk_size=CHUNK)
        assert store.last_report.reused == (cut - 1) // S * S
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert_same_state(warm, fresh, restored=True)
        if cut == len(ids):
            steps = decode_steps(model, warm, got)
            assert all(np.array_equal(a, b) for a, b in zip(steps, ref_steps))


def test_a_prompt_that_is_a_whole_number_of_segments_still_prefills_its_last_one(model, tmp_path):
    ids = store_prompt(2 * S)
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)
    assert store.last_report.stored == [2 * S]
    warm = model.make_cache("pqo4")
    got = store.prefill(model, ids, warm, chunk_size=CHUNK)
    assert store.last_report.reused == 0 and store.last_report.computed == 2 * S  # 2S itself leaves nothing to run
    longer = ids + store_prompt(5, seed=1)
    fresh = model.make_cache("pqo4")
    want = segmented_prefill(model, longer, fresh, chunk_tokens=S, chunk_size=CHUNK)
    warm = model.make_cache("pqo4")
    assert np.array_equal(store.prefill(model, longer, warm, chunk_size=CHUNK), want)
    assert store.last_report.reused == 2 * S
    del got


def test_policy_last_stores_the_longest_boundary_and_a_conversation_finds_it(model, tmp_path):
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    turn1 = store_prompt(S + 40)
    store.prefill(model, turn1, model.make_cache("int4"), chunk_size=CHUNK)
    assert store.last_report.stored == [S]
    turn2 = turn1 + store_prompt(2 * S, seed=5)
    store.prefill(model, turn2, model.make_cache("int4"), chunk_size=CHUNK)
    assert store.last_report.reused == S and store.last_report.stored == [3 * S]
    assert len(store.backend.entries()) == 2
    none = PrefixStore(store.backend, chunk_tokens=S, policy="none")
    none.prefill(model, store_prompt(4 * S, seed=9), model.make_cache("int4"), chunk_size=CHUNK)
    assert none.last_report.stored == [] and len(store.backend.entries()) == 2


def test_keys_separate_models_methods_options_and_schedules(model, tmp_path):
    from tiny_models import store_model

    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    ids = store_prompt(2 * S)
    base = store.keys(model, model.make_cache("pqo4"), ids, chunk_size=CHUNK)
    assert len(base) == 2
    others = [
        store.keys(store_model(seed=4), model.make_cache("pqo4"), ids, chunk_size=CHUNK),
        store.keys(model, model.make_cache("pqo3"), ids, chunk_size=CHUNK),
        store.keys(model, model.make_cache("pqo4", seed=1), ids, chunk_size=CHUNK),
        store.keys(model, model.make_cache("pqo4"), ids, chunk_size=16),
        store.keys(model, model.make_cache("pqo4"), ids, chunk_size=CHUNK, prompt_store="chunks"),
        PrefixStore(store.backend, chunk_tokens=S, model_id="other").keys(
            model, model.make_cache("pqo4"), ids, chunk_size=CHUNK
        ),
    ]
    for keys in others:
        assert not set(keys) & set(base)
    changed = ids[:S] + [(ids[S] + 1) % 101] + ids[S + 1 :]
    k2 = store.keys(model, model.make_cache("pqo4"), changed, chunk_size=CHUNK)
    assert k2[0] == base[0] and k2[1] != base[1]  # the chain: equal up to the first changed chunk


def test_generate_with_a_store_gives_the_tokens_of_the_schedule(model, tmp_path):
    ids = store_prompt(2 * S + 30)
    ref = model.make_cache("pqo4")
    logits = segmented_prefill(model, ids, ref, chunk_tokens=S, chunk_size=CHUNK)
    want = [int(np.argmax(logits))] + [int(np.argmax(x)) for x in decode_steps(model, ref, logits, 5)]
    store = PrefixStore(tmp_path, chunk_tokens=S)
    cold = model.generate(ids, 6, method="pqo4", store=store, prefill_chunk=CHUNK, stop_at_eos=False)
    warm = model.generate(ids, 6, method="pqo4", store=store, prefill_chunk=CHUNK, stop_at_eos=False)
    assert store.last_report.reused == 2 * S
    assert cold == warm == want[:6]
    with pytest.raises(TypeError, match="store backend"):
        model.generate(ids, 2, store=42)


def sealed(store, model, ids, j, body):
    """``body`` in the envelope of the entry ``store`` would write for the first ``j`` chunks of ``ids``."""
    keys = store.keys(model, model.make_cache("pqo4"), ids, chunk_size=CHUNK)
    return seal_entry(store._binding(keys, ids, j), body, store._tenant, method="pqo4")


def test_a_crafted_or_foreign_entry_is_refused_the_prompt_computed_and_the_entry_replaced(model, tmp_path):
    ids = store_prompt(S + 20)
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    key = store.keys(model, model.make_cache("pqo4"), ids, chunk_size=CHUNK)[0]
    fresh = model.make_cache("pqo4")
    want = segmented_prefill(model, ids, fresh, chunk_tokens=S, chunk_size=CHUNK)

    other = model.make_cache("pqo3")  # a valid entry of another configuration under the key
    model.prefill(ids[:S], other, chunk_size=CHUNK)
    short = model.make_cache("pqo4")  # the right configuration, the wrong length
    model.prefill(ids[: S - 1], short, chunk_size=CHUNK)
    good = encode_cache(fresh)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    for bad, why in (
        (b"not a cache file", "not a (cache file|store entry)"),  # refused by the backend or the reader
        (good, "not a store entry"),  # a bare cache file: no binding
        (sealed(store, model, ids, 1, bytes(flipped)), "checksum"),
        (sealed(store, model, ids, 1, encode_cache(other)), "another configuration"),
        (sealed(store, model, ids, 1, encode_cache(short)), f"should hold {S}"),
    ):
        store.backend.put(key, bad)
        warm = model.make_cache("pqo4")
        with pytest.warns(StoreWarning, match=why):
            got = store.prefill(model, ids, warm, chunk_size=CHUNK)
        assert store.last_report.reused == 0 and np.array_equal(got, want)
        assert store.last_report.stored == [S]  # the refused entry replaced by the one computed
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)
        assert store.last_report.reused == S and np.array_equal(again, want)
        strict = PrefixStore(store.backend, chunk_tokens=S, on_error="raise")
        store.backend.put(key, bad)
        empty = model.make_cache("pqo4")
        with pytest.raises(EntryError, match=why):
            strict.prefill(model, ids, empty, chunk_size=CHUNK)
        assert empty.seq_len(0) == 0  # a refused entry leaves the cache as it was


@pytest.mark.parametrize("method", ["pqo4", "int4"])
def test_an_entry_without_rollback_copies_continues_the_same(model, method):
    ids = store_prompt(90)
    c = model.make_cache(method)
    model.prefill(ids[:60], c, chunk_size=CHUNK)
    for t in ids[60:]:  # decode steps: the copies now reach back into them
        model.decode(t, c)
    assert c.min_truncate_length(0) < 90
    full, lean = encode_cache(c), encode_cache(c, rollback_copies=False)
    copies = sum(r.arrays[n].nbytes for r in c.snapshot(host=True) for n in ROLLBACK_ARRAYS)
    assert copies > 0 and copies <= len(full) - len(lean) <= copies + 1024  # the copies' bytes (and header digits)
    target = model.make_cache(method)
    restore_entry(target, lean, tokens=90)
    assert_same_state(target, c, restored=True)
    assert target.min_truncate_length(0) > c.min_truncate_length(0)  # no going back into the prefix
    with pytest.raises(ValueError):
        target.truncate(0, c.min_truncate_length(0))
    token = int(ids[-1])
    for _ in range(41):  # past the window and rollback_tokens: the copies are the original's again
        a, b = model.decode(token, target), model.decode(token, c)
        assert np.array_equal(np.asarray(a), np.asarray(b))
        token = int(np.argmax(np.asarray(a)))
    assert_same_state(target, c)


def test_restore_entry_checks(model):
    ids = store_prompt(40)
    c = model.make_cache("int4")
    model.prefill(ids, c)
    data = encode_cache(c)
    target = model.make_cache("int4")
    restore_entry(target, data, tokens=40)
    assert_same_state(target, c)
    with pytest.raises(EntryError, match="should hold 41"):
        restore_entry(model.make_cache("int4"), data, tokens=41)
    with pytest.raises(TypeError, match="bytes"):
        restore_entry(model.make_cache("int4"), "text")
    with pytest.raises(TypeError, match="arraykv cache"):
        encode_cache(object())


def test_bad_arguments(model, tmp_path):
    for kwargs, match in (
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"policy": "all"}, "policy"),
        ({"on_error": "ignore"}, "on_error"),
        ({"model_id": ""}, "model_id"),
    ):
        with pytest.raises(ValueError, match=match):
            PrefixStore(tmp_path, **kwargs)
    store = PrefixStore(tmp_path, chunk_tokens=S)
    c = model.make_cache("dense")
    model.prefill([1, 2, 3], c)
    with pytest.raises(ValueError, match="empty"):
        store.prefill(model, [1, 2, 3], c)
    with pytest.raises(ValueError, match="at least one"):
        store.prefill(model, [], model.make_cache("dense"))
    with pytest.raises(TypeError, match="integers"):
        store.prefill(model, [1.5, 2], model.make_cache("dense"))


def test_a_failing_server_is_a_warning_not_a_failed_generation(model, valkey_server):
    """The server stops: lookups and stores fail with a warning, the prompt is computed."""
    from arraykv.store import ValkeyServer, ValkeyStore

    ids = store_prompt(S + 10)
    fresh = model.make_cache("pqo4")
    want = segmented_prefill(model, ids, fresh, chunk_tokens=S, chunk_size=CHUNK)
    server = ValkeyServer().start()
    store = PrefixStore(ValkeyStore(server.url), chunk_tokens=S)
    server.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)
    assert np.array_equal(got, want) and store.last_report.stored == []
    assert any(issubclass(w.category, StoreWarning) and "could not" in str(w.message) for w in caught)
