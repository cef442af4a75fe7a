"""A prompt fed to a polar cache in chunks decodes each encoded token once (``prefill_decoded``),
and every chunk still gets exactly the K/V of a fresh decode of the whole layer."""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv.caches.polar_decode import decode_layer, qjl_logit_bias
from cache_contract import random_kvq

H, G, D = 2, 2, 16
CFG = arraykv.AttendConfig(n_kv_groups=G, softmax_scale=0.25)


def _fresh(cache, q):
    """What the chunk's answer must be: the whole layer decoded now, with no earlier work reused."""
    st = cache._states[0]
    fixed = cache._codec(np, None)
    k, v = decode_layer(st, fixed, cache.options)
    bias = qjl_logit_bias(st, fixed, q, 0.25) if cache.qjl and st.codes.length else None
    return k, v, bias


@pytest.mark.parametrize("method,options", [("pqo4", {"outliers": 2}), ("tq3", {"residual_window": 5}),
                                            ("pqo2", {"sink_tokens": 0, "residual_window": 0})])
def test_chunks_answer_a_fresh_decode_and_reuse_the_decoded_tokens(rng, method, options):
    c = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, softmax_scale=0.25, **options)
    calls = []
    st_decode = arraykv.caches.polar.decode_codes

    def counting(st, fixed, opts, c0=0):
        calls.append((c0, st.codes.length))
        return st_decode(st, fixed, opts, c0)

    arraykv.caches.polar.decode_codes = counting
    try:
        for step in range(12):
            t = int(rng.integers(1, 40))
            k, v, q = random_kvq(rng, np, 1, H, G, t, D)
            held = c.seq_len(0)
            r = c.prefill(0, k, v, q)
            if held:
                want_k, want_v, want_bias = _fresh(c, q)
                np.testing.assert_array_equal(r.k, want_k)
                np.testing.assert_array_equal(r.v, want_v)
                if want_bias is None:
                    assert r.logit_bias is None
                else:
                    np.testing.assert_array_equal(r.logit_bias, want_bias)
            st = c._states[0]
            if st.prefill_decoded is not None:
                assert int(st.prefill_decoded[0].shape[2]) == st.codes.length
                extra = sum(a.nbytes for a in st.prefill_decoded)
                assert c.memory_usage() - c.used_bytes() >= extra  # counted while held
            if step == 4:  # a decode step drops the decoded tokens
                k, v, q = random_kvq(rng, np, 1, H, G, 1, D)
                c.decode(0, k, v, q, CFG)
                assert c._states[0].prefill_decoded is None
            if step == 8:  # so does a truncation
                c.truncate(0, max(c.min_truncate_length(0), c.seq_len(0) - 3))
                assert c._states[0].prefill_decoded is None
    finally:
        arraykv.caches.polar.decode_codes = st_decode
    # each chunk decoded only the tokens encoded since the one before (from 0 after a decode/truncation)
    starts = [c0 for c0, _ in calls]
    assert sum(n - c0 for c0, n in calls) < sum(n for _, n in calls)
    assert all(c0 <= n for c0, n in calls) and starts.count(0) <= 3
