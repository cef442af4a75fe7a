"""Every supported architecture: tiny GGUF files of random weights, read by arraykv's decoder and by transformers.

The decoder is one class driven by an :class:`~arraykv.integrations.decoder.architectures.Architecture`;
these tests write a small model of each architecture with :func:`write_gguf` and check that
its logits are transformers' (the same file, float32) and that every way of feeding the tokens
(one call, chunks, decode steps, a hybrid cache for sliding layers) gives the same logits.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")

from arraykv.integrations.decoder.architectures import ARCHITECTURES, architecture, periodic_layer_types  # noqa: E402
from arraykv.integrations.decoder.gguf_loading import load_model  # noqa: E402
from arraykv.integrations.decoder.gguf_reader import read_gguf  # noqa: E402
from arraykv.integrations.decoder.gguf_writer import write_gguf  # noqa: E402
from arraykv.integrations.decoder.model import random_gguf_tensors  # noqa: E402

from tiny_models import arch_config, decoder  # noqa: E402


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def written(request, tmp_path_factory):
    arch = request.param
    cfg = arch_config(arch)
    tensors = random_gguf_tensors(cfg, seed=3)
    folder = tmp_path_factory.mktemp(arch)
    write_gguf(folder / "m.gguf", cfg, tensors)
    return arch, cfg, tensors, folder


def _ids(n=40, seed=0):
    return np.random.default_rng(seed).integers(0, 128, n)


def test_written_file_reads_back_its_config_and_tensors(written):
    arch, cfg, tensors, folder = written
    got, arrays, _ = read_gguf(folder / "m.gguf")
    assert got.arch == arch and got.layer_types == cfg.layer_types and got.sliding_window == cfg.sliding_window
    assert (got.num_layers, got.head_dim, got.num_kv_heads) == (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads)
    for name, a in tensors.items():
        np.testing.assert_array_equal(arrays[name], a)


def test_logits_equal_transformers_on_the_same_file(written):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    arch, cfg, _, folder = written
    extra = {"query_pre_attn_scalar": cfg.head_dim} if arch == "gemma3" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file="m.gguf", dtype=torch.float32, **extra
    ).eval()
    if arch == "gemma3":
        assert list(hf.config.layer_types) == list(cfg.layer_types)
    ids = _ids()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    model = load_model(folder / "m.gguf", reuse=False, tokenizer=False)
    ours = model.forward(ids)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    # the path users run: chunks through the model's own cache, then decode steps
    cache = model.make_cache("dense")
    first = model.prefill(ids[:17], cache, chunk_size=5)
    steps = np.stack([model.decode(int(t), cache) for t in ids[17:]])
    np.testing.assert_allclose(np.concatenate([first, steps]), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_hybrid_model_gets_a_hybrid_cache_that_holds_only_the_window():
    cfg = arch_config("gemma3", num_layers=6, layer_types=periodic_layer_types(6, 3), sliding_window=5)
    model = decoder(cfg, seed=1)
    ids = _ids(60, seed=2)
    exact = model.forward(ids)
    for method in ("dense", "pqo4"):
        cache = model.make_cache(method, window_options={"rollback_tokens": 2})
        assert type(cache).__name__ == "HybridCache"
        out = np.concatenate(
            [model.prefill(ids[:23], cache, chunk_size=4), np.stack([model.decode(int(t), cache) for t in ids[23:]])]
        )
        for i, kind in enumerate(cfg.layer_types):
            assert cache.seq_len(i) == 60
            held = cache.sliding.held_tokens(i) if kind == "sliding_attention" else cache.seq_len(i)
            assert held == (5 + 2 if kind == "sliding_attention" else 60)
        if method == "dense":  # exact: the same logits as the uncached forward
            np.testing.assert_allclose(out, exact, rtol=0, atol=2e-5 * np.abs(exact).max())
        else:
            assert np.mean(out.argmax(-1) == exact.argmax(-1)) > 0.7


def test_a_full_attention_cache_on_a_hybrid_model_still_attends_through_the_window():
    """A user's cache that keeps every token (any method built for all layers) is read through the
    window: the decoder slices or masks what it returns."""
    import arraykv

    cfg = arch_config("gemma3", num_layers=3, layer_types=periodic_layer_types(3, 3), sliding_window=4)
    model = decoder(cfg, seed=5)
    ids = _ids(30, seed=4)
    plain = arraykv.make_cache("dense", num_layers=3, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    out = np.concatenate(
        [model.prefill(ids[:11], plain, chunk_size=3), np.stack([model.decode(int(t), plain) for t in ids[11:]])]
    )
    np.testing.assert_allclose(out, model.forward(ids), rtol=0, atol=2e-5)


def test_unknown_architecture_and_kinds_are_refused_clearly():
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported; supported: gemma3, llama"):
        architecture("mamba")
    import arraykv

    with pytest.raises(ValueError, match="chunked attention"):
        arraykv.make_cache(
            "hybrid",
            num_layers=2,
            num_kv_heads=1,
            head_dim=8,
            window=4,
            layer_types=["full_attention", "chunked_attention"],
        )


def test_prompt_store_exact_attends_to_the_exact_prompt_and_stores_it_compressed():
    cfg = arch_config("llama", num_layers=3)
    model = decoder(cfg, seed=7)
    ids = _ids(70, seed=8)
    exact = model.forward(ids[:64])
    staged_cache = model.make_cache("pqo4")
    staged = model.prefill(ids[:64], staged_cache, chunk_size=16)
    # every prompt position is computed over float16-rounded exact K/V: close to exact, not compressed
    assert np.abs(staged - exact).max() <= 2e-3 * np.abs(exact).max()
    chunked_cache = model.make_cache("pqo4")
    chunked = model.prefill(ids[:64], chunked_cache, chunk_size=16, prompt_store="chunks")
    assert np.abs(chunked - exact).max() > np.abs(staged - exact).max()
    assert [staged_cache.seq_len(i) for i in range(3)] == [64] * 3
    # the stored prompt equals one append of the staged keys (float16) per layer
    ref = model.make_cache("pqo4")
    rec = model.make_cache("dense")
    model.prefill(ids[:64], rec, chunk_size=16)
    for i in range(3):
        r = rec.dequantize(i)
        k16, v16 = (a.astype(np.float16).astype(np.float32) for a in (r.k, r.v))
        np.testing.assert_array_equal(staged_cache.dequantize(i).k.shape, k16.shape)
        assert np.abs(staged_cache.dequantize(i).k - k16).max() < 0.5 * np.abs(k16).max()
    # decoding continues from the stored prompt
    logits = model.decode(int(ids[64]), staged_cache)
    assert logits.shape == (cfg.vocab_size,) and np.isfinite(logits).all()
    del ref


def test_prompt_store_exact_continues_a_cache_that_holds_earlier_tokens():
    cfg = arch_config("qwen3", num_layers=2)
    model = decoder(cfg, seed=9)
    ids = _ids(50, seed=10)
    cache = model.make_cache("int4")
    model.prefill(ids[:20], cache)
    out = model.prefill(ids[20:50], cache, chunk_size=8)
    assert cache.seq_len(0) == 50 and out.shape == (30, cfg.vocab_size)
    exact = model.forward(ids)[20:50]
    assert np.mean(out.argmax(-1) == exact.argmax(-1)) > 0.7


def test_prompt_store_is_checked_and_a_failed_commit_leaves_the_cache_as_it_was():
    cfg = arch_config("llama", num_layers=2)
    model = decoder(cfg, seed=11)
    ids = _ids(40, seed=12)
    cache = model.make_cache("pqo4")
    with pytest.raises(ValueError, match="prompt_store must be 'exact' or 'chunks'"):
        model.prefill(ids, cache, prompt_store="fast")
    model.prefill(ids[:10], cache)
    before = [cache.layer_arrays(i) for i in range(2)]
    real_append = cache.append

    def failing_append(layer, k, v, q):
        if layer == 1:
            raise MemoryError("injected")
        return real_append(layer, k, v, q)

    cache.append = failing_append
    with pytest.raises(MemoryError, match="injected"):
        model.prefill(ids[10:40], cache, chunk_size=8)
    del cache.append
    assert [cache.seq_len(i) for i in range(2)] == [10, 10]
    for i in range(2):
        after = cache.layer_arrays(i)
        assert after.keys() == before[i].keys()
        for name in after:
            np.testing.assert_array_equal(after[name], before[i][name])


@pytest.mark.parametrize("method", ["dense", "pqo4", "int4"])
def test_speculative_decoding_on_a_hybrid_cache_is_plain_greedy(method):
    """Drafts verified and rolled back on a hybrid cache (sliding layers past their window):
    the output is the model's greedy decoding through that cache, token for token."""
    from arraykv.integrations.decoder.speculative import CacheDraft, LayerDraft, NgramDraft, speculative_generate

    cfg = arch_config(
        "gemma3",
        num_layers=6,
        layer_types=periodic_layer_types(6, 3),
        sliding_window=8,
        hidden_size=32,
        head_dim=8,
        vocab_size=64,
    )
    model = decoder(cfg, seed=1)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 64, 30)]
    want = model.generate(ids, 40, cache=model.make_cache(method))
    for draft in (NgramDraft(), LayerDraft(2), CacheDraft("pqo2")):
        cache = model.make_cache(method)
        got = speculative_generate(model, ids, 40, cache=cache, draft=draft, k=4)
        assert got.tokens == want and cache.seq_len(0) == 30 + 40 - 1


def test_bits_per_value_of_a_hybrid_cache_count_what_it_holds():
    """The eval's bits per value divide the bytes held by the values held: a sliding layer holds its
    window, not every token (dense float32 stays at 32 bits past the window)."""
    from arraykv import eval as ev

    cfg = arch_config("gemma3", num_layers=3, layer_types=periodic_layer_types(3, 3), sliding_window=5)
    model = decoder(cfg, seed=2)
    ids = [int(t) for t in _ids(60, seed=3)]
    rows = ev.evaluate(model, ids, ["dense"], prefill=40)
    assert abs(rows[0].bits_per_value - 32.0) < 0.5
