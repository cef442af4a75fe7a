"""On the real model: a prompt continued from a stored prefix gives a fresh run's logits and tokens."""

from __future__ import annotations

import numpy as np
import pytest

from arraykv.store import LocalStore, PrefixStore, segmented_prefill

from cache_contract import assert_same_state


@pytest.mark.slow
def test_smollm2_pqo4_continues_a_stored_prefix_bit_for_bit(tmp_path):
    from arraykv import eval as ev

    from smollm import smollm_or_skip

    model = smollm_or_skip()
    ids = ev.builtin_token_ids(model, 300)
    fresh = model.make_cache("pqo4")
    want = segmented_prefill(model, ids, fresh, chunk_tokens=128, chunk_size=64)
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=128)
    cold = store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=64)
    assert store.last_report.stored == [256] and np.array_equal(cold, want)
    warm_cache = model.make_cache("pqo4")
    warm = store.prefill(model, ids, warm_cache, chunk_size=64)
    assert store.last_report.reused == 256 and store.last_report.computed == 44
    assert np.array_equal(warm, want)
    assert_same_state(warm_cache, fresh, restored=True)  # an entry leaves out the rollback copies
    # and the next steps: generation through the store gives the tokens of the fresh cache
    tokens = [int(np.argmax(want))]
    for _ in range(3):
        tokens.append(int(np.argmax(model.decode(tokens[-1], fresh))))
    got = model.generate(ids, 4, method="pqo4", store=store, prefill_chunk=64, stop_at_eos=False)
    assert store.last_report.reused == 256 and got == tokens
