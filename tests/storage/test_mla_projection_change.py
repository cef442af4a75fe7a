"""Replacing the projections of an MLA layer that holds latents is refused, never silent."""

import numpy as np
import pytest

from arraykv import MlaCache

H, D, R, L = 2, 12, 4, 6


def _kv(rng, t):
    k = rng.standard_normal((H, t, D)).astype(np.float32)
    v = rng.standard_normal((H, t, D - R)).astype(np.float32)
    return k, v


def test_fit_or_set_projection_on_a_layer_holding_latents_is_refused(rng):
    cache = MlaCache(num_layers=2, num_heads=H, head_dim=D, latent_dim=L, rope_dim=R)
    k, v = _kv(rng, 40)
    cache.fit(0, k, v)
    cache.fit(1, k, v)
    sid = cache.allocate_sequence()
    cache.append(0, sid, k[:, :5], v[:, :5])
    before = [np.array(a) for a in cache.get_kv(0, sid)]
    proj = [np.array(a) for a in cache.projection(0)]
    k2, v2 = _kv(rng, 40)
    with pytest.raises(ValueError, match=r"reset_layer\(0\)"):
        cache.fit(0, k2, v2)
    up_k = rng.standard_normal((H, D - R, L)).astype(np.float32)
    up_v = rng.standard_normal((H, D - R, L)).astype(np.float32)
    with pytest.raises(ValueError, match=r"seq_ids \[0\].*reset_layer"):
        cache.set_projection(0, up_k, up_v)
    # nothing changed: the same projections, the same reconstruction
    for a, b in zip(cache.projection(0), proj):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(cache.get_kv(0, sid), before):
        np.testing.assert_array_equal(np.asarray(a), b)
    # a layer without tokens (layer 1) still takes new projections
    cache.set_projection(1, up_k, up_v)
    # after reset_layer the layer is empty, keeps its sequence ids and takes new projections
    cache.reset_layer(0)
    assert cache.seq_len(0, sid) == 0
    cache.set_projection(0, up_k, up_v)
    cache.append(0, sid, k[:, :5], v[:, :5])
    assert cache.seq_len(0, sid) == 5


def test_freed_sequences_do_not_block_a_new_projection(rng):
    cache = MlaCache(num_layers=1, num_heads=H, head_dim=D, latent_dim=L, rope_dim=R)
    k, v = _kv(rng, 40)
    cache.fit(0, k, v)
    sid = cache.allocate_sequence()
    cache.append(0, sid, k[:, :3], v[:, :3])
    cache.free(sid)
    cache.fit(0, *_kv(rng, 40))
