"""Every bad input gets a clear ValueError/TypeError and leaves the cache exactly as it was.

Parametrized over every registered method, so each new cache is held to the same rules.
"""

import numpy as np
import pytest

import arraykv

from cache_contract import assert_same_snapshot, snapshot
from conftest import BUILTIN_METHODS

H, D, G = 2, 32, 2


def _filled(method):
    cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=H, head_dim=D)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, H, 20, D)).astype(np.float32)
    v = rng.standard_normal((2, H, 20, D)).astype(np.float32)
    q = rng.standard_normal((2, H * G, 20, D)).astype(np.float32)
    cache.prefill(0, k, v, q)
    cache.prefill(0, k[:, :, :3], v[:, :, :3], q[:, :, :3])
    return cache


def _kvq(b=2, h=H, t=1, d=D, qh=H * G, dtype=np.float32):
    rng = np.random.default_rng(2)
    return (
        rng.standard_normal((b, h, t, d)).astype(dtype),
        rng.standard_normal((b, h, t, d)).astype(dtype),
        rng.standard_normal((b, qh, t, d)).astype(dtype),
    )


def _bad_calls():
    cfg = arraykv.AttendConfig(0.2, G)
    k, v, q = _kvq()
    nan = k.copy()
    nan[1, 0, 0, 3] = np.nan
    inf = v.copy()
    inf[0, 1, 0, 0] = -np.inf
    import array_api_strict as xs

    return {
        "k rank 3": (ValueError, lambda c: c.decode(0, k[0], v[0], q, cfg)),
        "q rank 3": (ValueError, lambda c: c.decode(0, k, v, q[0], cfg)),
        "kv heads": (ValueError, lambda c: c.decode(0, *_kvq(h=3, qh=6), arraykv.AttendConfig(0.2, 2))),
        "head_dim": (ValueError, lambda c: c.decode(0, *_kvq(d=D + 1), cfg)),
        "q heads not multiple": (ValueError, lambda c: c.decode(0, k, v, _kvq(qh=3)[2], cfg)),
        "batch vs stored": (ValueError, lambda c: c.decode(0, *_kvq(b=3), cfg)),
        "batch k vs q": (ValueError, lambda c: c.decode(0, k, v, _kvq(b=3)[2], cfg)),
        "decode 2 tokens": (ValueError, lambda c: c.decode(0, *_kvq(t=2), cfg)),
        "prefill q tokens": (ValueError, lambda c: c.prefill(0, *_kvq(t=2)[:2], q)),
        "layer too big": (ValueError, lambda c: c.decode(2, k, v, q, cfg)),
        "layer negative": (ValueError, lambda c: c.prefill(-1, k, v, q)),
        "layer float": (TypeError, lambda c: c.seq_len(0.5)),
        "int dtype": (TypeError, lambda c: c.decode(0, k.astype(np.int32), v.astype(np.int32), q, cfg)),
        "dtype vs stored": (TypeError, lambda c: c.decode(0, *_kvq(dtype=np.float64), cfg)),
        "k v dtypes": (TypeError, lambda c: c.decode(0, k, v.astype(np.float64), q, cfg)),
        "k v shapes": (ValueError, lambda c: c.prefill(0, k, _kvq(t=2)[1], q)),
        "namespaces": (TypeError, lambda c: c.decode(0, k, xs.asarray(v), q, cfg)),
        "q namespace": (TypeError, lambda c: c.decode(0, k, v, xs.asarray(q), cfg)),
        "not an array": (TypeError, lambda c: c.decode(0, k.tolist(), v, q, cfg)),
        "nan in k": (ValueError, lambda c: c.decode(0, nan, v, q, cfg)),
        "inf in v": (ValueError, lambda c: c.prefill(0, k, inf, q)),
        "config type": (TypeError, lambda c: c.decode(0, k, v, q, 0.2)),
        "config groups": (ValueError, lambda c: c.decode(0, k, v, q, arraykv.AttendConfig(0.2, 4))),
        "empty tokens": (ValueError, lambda c: c.prefill(0, *_kvq(t=0))),
    }


@pytest.mark.parametrize("method", BUILTIN_METHODS)
@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_input_rejected_and_cache_unchanged(method, case):
    exc, call = _bad_calls()[case]
    cache = _filled(method)
    before = snapshot(cache)
    with pytest.raises(exc) as info:
        call(cache)
    assert type(info.value) in (ValueError, TypeError)
    assert str(info.value)
    assert_same_snapshot(before, snapshot(cache))


def test_config_validation():
    with pytest.raises(ValueError, match="softmax_scale"):
        arraykv.AttendConfig(0.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        arraykv.AttendConfig(float("nan"))
    with pytest.raises(TypeError, match="softmax_scale"):
        arraykv.AttendConfig("1")
    with pytest.raises(ValueError, match="n_kv_groups"):
        arraykv.AttendConfig(1.0, 0)
    assert arraykv.AttendConfig(1).softmax_scale == 1.0


def test_factory_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'.*dense"):
        arraykv.make_cache("nope", num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(TypeError, match="does not take"):
        arraykv.make_cache("dense", num_layers=1, num_kv_heads=1, head_dim=8, bogus=3)
    with pytest.raises(ValueError, match="num_layers"):
        arraykv.make_cache("dense", num_layers=0, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="already registered"):
        arraykv.register_method("dense")(arraykv.DenseCache.__base__)


def test_register_third_party_method():
    @arraykv.register_method("test-dense-copy", replace=True)
    def factory(**kw):
        return arraykv.DenseCache(**kw)

    assert "test-dense-copy" in arraykv.available_methods()
    assert isinstance(
        arraykv.make_cache("test-dense-copy", num_layers=1, num_kv_heads=1, head_dim=4), arraykv.DenseCache
    )
