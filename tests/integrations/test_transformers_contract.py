"""ArraykvCache over a cache that has the five contract methods and nothing more (skipped without torch
or transformers).

What ArraykvCache uses beyond :class:`~arraykv.CompressedKVCache` it asks for by capability
(:func:`arraykv.protocol.supports`): such a cache decodes as the same cache with every capability
does, and what it cannot do (moving batch rows, dropping tokens) is refused by name. And
:func:`generate_with_store` takes an ArraykvCache, not any cache carrying an ``arraykv_cache``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import arraykv  # noqa: E402
from arraykv.caches import registry  # noqa: E402
from arraykv.integrations.transformers import ArraykvCache, generate_with_store  # noqa: E402
from arraykv.protocol import capabilities  # noqa: E402

from tiny_models import HF_VOCAB, hf_llama  # noqa: E402

METHOD = "test-five-methods"


class FiveMethods:
    """A dense cache seen through the five contract methods only."""

    def __init__(self, **options):
        self._inner = arraykv.DenseCache(**options)

    def prefill(self, layer, k, v, q):
        return self._inner.prefill(layer, k, v, q)

    def decode(self, layer, k, v, q, config):
        return self._inner.decode(layer, k, v, q, config)

    def seq_len(self, layer):
        return self._inner.seq_len(layer)

    def reset(self):
        self._inner.reset()

    def memory_usage(self):
        return self._inner.memory_usage()


@pytest.fixture(scope="module")
def tiny():
    return hf_llama(0)


@pytest.fixture
def five_methods(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, METHOD, FiveMethods)
    return METHOD


def _ids(batch: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, HF_VOCAB, (batch, n), generator=g)


def _generate(model, cache, ids, **kw):
    with torch.no_grad():
        out = model.generate(
            ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None, **kw
        )
    cache.detach()
    return out


def test_the_stand_in_has_only_the_contract(five_methods):
    cache = arraykv.make_cache(five_methods, num_layers=1, num_kv_heads=1, head_dim=8)
    assert capabilities(cache) == ("kv_cache",)
    assert "incremental" in capabilities(arraykv.DenseCache(num_layers=1, num_kv_heads=1, head_dim=8))


@pytest.mark.parametrize("options", [{}, {"model": True}, {"incremental": True}], ids=["plain", "model", "incremental"])
def test_a_cache_of_the_five_methods_decodes_as_dense(tiny, five_methods, options):
    ids = _ids(1, 9)
    kw = {k: (tiny if k == "model" else v) for k, v in options.items()}
    out = _generate(tiny, ArraykvCache(five_methods, config=tiny.config, **kw), ids)
    ref = _generate(tiny, ArraykvCache("dense", config=tiny.config, **kw), ids)
    assert torch.equal(out, ref)


def test_what_the_five_methods_cannot_do_is_refused_by_name(tiny, five_methods):
    cache = ArraykvCache(five_methods, config=tiny.config)
    with torch.no_grad():
        tiny(input_ids=_ids(2, 5), cache=cache)
    with pytest.raises(NotImplementedError, match="batch rows"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(NotImplementedError, match="batch rows"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError, match="no truncate"):
        cache.crop(-1)
    assert cache.get_seq_length() == 5
    cache.layers[0].reset()  # no truncate: the whole cache is reset
    assert cache.get_seq_length() == 0


def test_generate_with_store_takes_an_arraykv_cache_only(tiny, tmp_path):
    from arraykv.store import LocalStore, PrefixStore

    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=4)
    stand_in = transformers.DynamicCache(config=tiny.config)
    stand_in.arraykv_cache = arraykv.make_cache("dense", num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(TypeError, match="ArraykvCache"):
        generate_with_store(tiny, _ids(1, 9), stand_in, store)
