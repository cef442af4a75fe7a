"""The QuantizedCache rows of benchmarks/transformers_caches.py on a tiny Llama: the caches run,
their bytes are counted as documented, and the rows are skipped when optimum-quanto is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "transformers_caches_bench", ROOT / "benchmarks" / "transformers_caches.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, cache, prompt: int, new: int):
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.generate(
            ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
        )


def test_quanto_rows_count_codes_scales_shifts_and_residual(bench, tiny):
    pytest.importorskip("optimum.quanto")
    configs = []
    note = bench._quanto_rows(transformers, tiny.config, 4, configs)
    assert "q_group_size=64" in note and "residual_length=128" in note
    assert [name for name, _ in configs] == [
        "QuantizedCache quanto int4, residual 128",
        "QuantizedCache quanto int4, residual 4",
        "QuantizedCache quanto int2, residual 128",
        "QuantizedCache quanto int2, residual 4",
    ]
    layers, heads, d = 2, 2, 16
    for (name, make), nbits, (quantized, residual) in zip(configs, (4, 4, 2, 2), ((8, 7), (12, 3), (8, 7), (12, 3))):
        cache = make()
        _generate(tiny, cache, prompt=8, new=8)  # the cache holds 8 + 7 tokens
        assert cache.get_seq_length() == quantized + residual
        # codes packed 8 // nbits groups of 64 to a byte row (the last row padded), then one float32
        # scale and one float32 zero-point per group, then the float32 residual
        groups = heads * quantized * d // 64
        packed = -(-groups // (8 // nbits)) * 64
        per_layer = 2 * (packed + groups * 4 * 2 + heads * residual * d * 4)
        assert bench._held(cache) == (layers * per_layer, layers * per_layer), name


def test_dynamic_cache_is_32_bits(bench, tiny):
    cache = transformers.DynamicCache(config=tiny.config)
    _generate(tiny, cache, prompt=8, new=4)
    assert bench._held(cache)[1] == 2 * 2 * 2 * 11 * 16 * 4


def test_held_rows_count_each_layers_tokens(bench, tiny):
    from arraykv.integrations.transformers import ArraykvCache

    cache = transformers.DynamicCache(config=tiny.config)
    _generate(tiny, cache, prompt=8, new=4)
    assert bench._held_rows(cache) == 2 * 11  # two layers of 11 tokens (the last one is not stored)
    ours = ArraykvCache("pqo4", config=tiny.config)
    _generate(tiny, ours, prompt=8, new=4)
    assert bench._held_rows(ours) == 2 * 11


def test_quanto_rows_skipped_without_quanto(bench, tiny, monkeypatch):
    import transformers.cache_utils

    monkeypatch.setattr(transformers.cache_utils, "is_optimum_quanto_available", lambda: False)
    configs = []
    note = bench._quanto_rows(transformers, tiny.config, 16, configs)
    assert configs == [] and note.startswith("QuantizedCache (quanto) rows skipped")
