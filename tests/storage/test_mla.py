import numpy as np
import pytest

import arraykv
from arraykv import KVCacheCompressor, LowRank, MlaCache

from conftest import asarray, to_np

H, D, R, L = 2, 12, 4, 6  # heads, head_dim, rope_dim, latent_dim


def latent_kv(rng, t, d_latent=L, up_k=None, up_v=None, shared=False):
    """K/V that truly come from a latent of size d_latent (plus a RoPE part)."""
    c = rng.standard_normal((t, d_latent))
    up_k = rng.standard_normal((H, D - R, d_latent)) if up_k is None else up_k
    up_v = rng.standard_normal((H, D - R, d_latent)) if up_v is None else up_v
    k_nope = np.einsum("hdl,tl->htd", up_k, c)
    rope = rng.standard_normal((1 if shared else H, t, R))
    k = np.concatenate([k_nope, np.broadcast_to(rope, (H, t, R))], axis=2)
    v = np.einsum("hdl,tl->htd", up_v, c)
    return k.astype(np.float32), v.astype(np.float32), c, up_k, up_v, rope


def make(**kw):
    opts = dict(num_layers=2, num_heads=H, head_dim=D, latent_dim=L, rope_dim=R)
    opts.update(kw)
    return MlaCache(**opts)


def test_fitted_projection_recovers_latent_data(xp, rng):
    k, v, *_ = latent_kv(rng, 200)
    cache = make()
    cache.fit(0, asarray(xp, k), asarray(xp, v))
    s = cache.allocate_sequence()
    k2, v2, *_ = latent_kv(rng, 7, up_k=_[0] if False else None)
    # New tokens from the same up projections: reuse them.
    kk, vv, _, uk, uv, _ = latent_kv(rng, 300)
    cache.fit(1, asarray(xp, kk), asarray(xp, vv))
    nk, nv, *_ = latent_kv(rng, 9, up_k=uk, up_v=uv)
    cache.append(1, s, asarray(xp, nk[:, :4]), asarray(xp, nv[:, :4]))
    cache.append(1, s, asarray(xp, nk[:, 4:]), asarray(xp, nv[:, 4:]))
    gk, gv = cache.get_kv(1, s)
    np.testing.assert_allclose(to_np(gk), nk, atol=2e-3)
    np.testing.assert_allclose(to_np(gv), nv, atol=2e-3)
    np.testing.assert_array_equal(to_np(gk)[:, :, D - R :], nk[:, :, D - R :])  # RoPE part exact
    lat, rope = cache.get_compressed_kv(1, s)
    assert lat.shape == (9, L) and rope.shape == (H, 9, R)
    assert cache.memory_usage() == 9 * (L + H * R) * 4
    assert cache.seq_len(1, s) == 9 and cache.seq_len(0, s) == 0


def test_fit_is_the_best_linear_latent(rng):
    k = rng.standard_normal((H, 300, D)).astype(np.float32)
    v = rng.standard_normal((H, 300, D - R)).astype(np.float32)
    cache = make(num_layers=1)
    cache.fit(0, k, v)
    s = cache.allocate_sequence()
    cache.append(0, s, k, v)
    gk, gv = cache.get_kv(0, s)
    z = np.concatenate([k[:, :, : D - R].transpose(1, 0, 2).reshape(300, -1), v.transpose(1, 0, 2).reshape(300, -1)], 1)
    zr = np.concatenate(
        [gk[:, :, : D - R].transpose(1, 0, 2).reshape(300, -1), gv.transpose(1, 0, 2).reshape(300, -1)], 1
    )
    sv = np.linalg.svd(z.astype(np.float64), compute_uv=False)
    assert np.sum((zr - z) ** 2) == pytest.approx(np.sum(sv[L:] ** 2), rel=1e-3)


def test_given_weights_and_model_latents(xp, rng):
    k, v, c, uk, uv, rope = latent_kv(rng, 5, shared=True)
    cache = make(shared_rope=True)
    cache.set_projection(0, asarray(xp, uk.astype(np.float32)), asarray(xp, uv.astype(np.float32)))
    s = cache.allocate_sequence()
    cache.append_compressed(0, s, asarray(xp, c.astype(np.float32)), asarray(xp, rope.astype(np.float32)))
    gk, gv = cache.get_kv(0, s)
    np.testing.assert_allclose(to_np(gk), k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(to_np(gv), v, rtol=1e-4, atol=1e-4)
    # append() with full K/V reaches the same latents through the pseudo-inverse.
    t = cache.allocate_sequence()
    cache.append(0, t, asarray(xp, k), asarray(xp, v))
    np.testing.assert_allclose(to_np(cache.get_compressed_kv(0, t)[0]), c, rtol=1e-3, atol=1e-3)
    assert cache.get_compressed_kv(0, t)[1].shape == (1, 5, R)


def test_errors(rng):
    cache = make()
    s = cache.allocate_sequence()
    k, v, c, uk, uv, rope = latent_kv(rng, 3)
    with pytest.raises(ValueError, match="no projections"):
        cache.append(0, s, k, v)
    cache.fit(0, *latent_kv(rng, 50)[:2])
    with pytest.raises(ValueError, match="shape"):
        cache.append(0, s, k[:, :, :5], v)
    with pytest.raises(ValueError, match="non-finite"):
        cache.append(0, s, k * np.nan, v)
    with pytest.raises(ValueError, match="k_rope is required"):
        cache.append_compressed(0, s, c.astype(np.float32))
    with pytest.raises(ValueError, match="latent must have shape"):
        cache.append_compressed(0, s, c[:, :2].astype(np.float32), rope.astype(np.float32))
    assert cache.seq_len(0, s) == 0
    with pytest.raises(ValueError, match="shared_rope"):
        make(shared_rope=True).fit(0, k, v) or None
        sh = make(shared_rope=True)
        sh.fit(0, *latent_kv(rng, 50)[:2])
        sh.append(0, sh.allocate_sequence(), k, v)
    with pytest.raises(ValueError, match="up_k must have shape"):
        cache.set_projection(1, uk[:, :2], uv)
    with pytest.raises(ValueError, match="latent_dim"):
        make(latent_dim=0)
    with pytest.raises(ValueError, match="rope_dim"):
        make(rope_dim=D)
    cache.free(s)
    with pytest.raises(ValueError, match="already freed"):
        cache.free(s)
    with pytest.raises(ValueError, match="was freed"):
        cache.get_kv(0, s)


def test_bridges(rng):
    kk, vv, _, uk, uv, _ = latent_kv(rng, 100)
    cache = make()
    cache.fit(0, kk, vv)
    s = cache.allocate_sequence()
    cache.append(0, s, kk[:, :20], vv[:, :20])
    comp = KVCacheCompressor(LowRank(energy=1.0))
    c = arraykv.compress_mla_cache(comp, cache, 0, s)
    t = cache.allocate_sequence()
    arraykv.decompress_to_mla_cache(comp, c, cache, 0, t)
    np.testing.assert_allclose(cache.get_kv(0, t)[1], cache.get_kv(0, s)[1], atol=1e-3)
