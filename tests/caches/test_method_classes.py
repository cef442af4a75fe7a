"""Every cache class knows its method name: configs and files rebuild the class that made them."""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv.caches.intq import Int4Cache, IntQuantCache
from arraykv.caches.polar import PolarCache, Pqo3Cache, Tq4Cache

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=32)


def _fill(cache, seed=0):
    r = np.random.default_rng(seed)
    k = r.standard_normal((1, 2, 40, 32)).astype(np.float32)
    v = r.standard_normal((1, 2, 40, 32)).astype(np.float32)
    q = r.standard_normal((1, 4, 40, 32)).astype(np.float32)
    cache.prefill(0, k, v, q)
    return cache


@pytest.mark.parametrize("method", arraykv.available_methods(generic=True))
def test_make_cache_of_get_config_rebuilds_the_same_class(method):
    opts = {
        "polar": dict(key_bits=3, value_bits=2),
        "int": dict(bits=4),
        "window": dict(window=8),
        "hybrid": dict(layer_types=["sliding_attention", "full_attention"], window=8, full_method="pqo4"),
    }.get(method, {})
    cache = arraykv.make_cache(method, **GEOM, **opts)
    cfg = cache.get_config()
    assert cfg["method"] == method == type(cache).method
    again = arraykv.make_cache(**cfg)
    assert type(again) is type(cache) and again.get_config() == cfg


@pytest.mark.parametrize(
    "build",
    [
        lambda: PolarCache(**GEOM, key_bits=3, value_bits=2, qjl=True),
        lambda: Pqo3Cache(**GEOM),
        lambda: Tq4Cache(**GEOM, residual_window=8),
        lambda: IntQuantCache(**GEOM, bits=2),
        lambda: Int4Cache(**GEOM),
    ],
    ids=["PolarCache", "Pqo3Cache", "Tq4Cache", "IntQuantCache", "Int4Cache"],
)
def test_a_cache_built_directly_saves_and_loads(tmp_path, build):
    cache = _fill(build())
    path = tmp_path / "c.akv"
    cache.save(path)
    back = arraykv.load(path)
    assert type(back) is type(cache) and back.get_config() == cache.get_config()
    np.testing.assert_array_equal(np.asarray(back.dequantize(0).k), np.asarray(cache.dequantize(0).k))


def test_presets_fix_what_their_name_says():
    assert Tq4Cache(**GEOM).qjl is True and Pqo3Cache(**GEOM).key_bits == 3
    with pytest.raises(TypeError):
        Tq4Cache(**GEOM, qjl=False)
    with pytest.raises(TypeError, match="does not take"):
        arraykv.make_cache("int4", **GEOM, bits=8)
    assert (
        "qjl" not in Tq4Cache(**GEOM).get_config()
        and "qjl" in PolarCache(**GEOM, key_bits=2, value_bits=2).get_config()
    )


def test_generic_families_are_listed_apart():
    assert "polar" not in arraykv.available_methods() and "int" not in arraykv.available_methods()
    assert {"polar", "int"} <= set(arraykv.available_methods(generic=True))


def test_a_registered_subclass_takes_the_registered_name(tmp_path):
    @arraykv.register_method("test-dense-subclass", replace=True)
    class Sub(arraykv.DenseCache):
        pass

    cache = _fill(arraykv.make_cache("test-dense-subclass", **GEOM))
    assert cache.get_config()["method"] == "test-dense-subclass"
    cache.save(tmp_path / "s.akv")
    assert type(arraykv.load(tmp_path / "s.akv")) is Sub


def test_built_in_methods_are_imported_when_first_made_not_when_listed():
    import subprocess
    import sys

    code = (
        "import sys, arraykv\n"
        "arraykv.available_methods(generic=True)\n"
        "assert 'arraykv.caches.vq' not in sys.modules and 'arraykv.caches.intq' not in sys.modules\n"
        "arraykv.make_cache('int4', num_layers=1, num_kv_heads=1, head_dim=8)\n"
        "assert 'arraykv.caches.intq' in sys.modules and 'arraykv.caches.vq' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_a_method_registered_by_path_is_imported_on_first_use():
    arraykv.register_method("test-lazy-int4", "arraykv.caches.intq:Int4Cache", replace=True)
    assert "test-lazy-int4" in arraykv.available_methods()
    assert type(arraykv.make_cache("test-lazy-int4", **GEOM)) is Int4Cache
    # decorating the very class a path names is that registration, not a second one
    arraykv.register_method("test-lazy-int4")(Int4Cache)
    with pytest.raises(ValueError, match="already registered"):
        arraykv.register_method("test-lazy-int4")(IntQuantCache)
    with pytest.raises(ValueError, match="'module:attr' path"):
        arraykv.register_method("test-lazy-bad", "arraykv.caches.intq.Int4Cache")
