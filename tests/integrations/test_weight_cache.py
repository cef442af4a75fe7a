"""The weight cache: a GGUF file's float32 weights, config and tokenizer kept on disk after the first load.

A second load maps the cached file instead of dequantizing; its logits are bit-identical to a
load without the cache; a stale (GGUF file changed) or damaged (truncated, a flipped byte) cache
file is rebuilt and never used; ``cache_weights=False`` and ``ARRAYKV_WEIGHT_CACHE=0`` turn it
off; a directory that cannot be written leaves it off without an error.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package (extra [model]) is not installed")

from arraykv.integrations.decoder import weight_cache  # noqa: E402
from arraykv.integrations.decoder.gguf_loading import _version, load_model  # noqa: E402
from arraykv.integrations.decoder.gguf_writer import write_gguf  # noqa: E402
from arraykv.integrations.decoder.weights import random_gguf_tensors  # noqa: E402

from tiny_models import GGUF_LLAMA_TOKENIZED as CFG, MERGES, byte_tokens  # noqa: E402

IDS = [5, 17, 3, 99, 42, 7]


def _write(path, cfg=CFG, seed=1, tokens=True):
    tensors = random_gguf_tensors(cfg, seed=seed)
    kw = {"tokens": byte_tokens(cfg.vocab_size), "merges": MERGES} if tokens else {}
    return Path(write_gguf(path, cfg, tensors, **kw))


def _mapped(a) -> bool:
    """Whether ``a`` is a view of a memory-mapped cache file (not of the GGUF file, nor in memory)."""
    while a is not None:
        if isinstance(a, np.memmap) and str(a.filename).endswith(".akw"):
            return True
        a = getattr(a, "base", None)
    return False


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "weights"
    monkeypatch.setenv("ARRAYKV_WEIGHT_CACHE", str(d))
    return d


def _files(d: Path) -> list:
    return sorted(d.glob("*.akw")) if d.exists() else []


def test_second_load_maps_the_cache_and_gives_identical_logits_and_tokens(tmp_path, cache):
    path = _write(tmp_path / "m.gguf")
    plain = load_model(path, reuse=False, cache_weights=False)
    assert _files(cache) == []
    first = load_model(path, reuse=False)
    assert len(_files(cache)) == 1 and not _mapped(first.embedding)
    second = load_model(path, reuse=False)
    assert _mapped(second.embedding) and _mapped(second.layers[1].wqkv)
    assert not second.embedding.flags.writeable
    assert second.config == plain.config
    ref = plain.forward(IDS)
    for m in (first, second):
        np.testing.assert_array_equal(m.forward(IDS), ref)
    text = "hello world hell"
    assert second.tokenizer.encode(text) == plain.tokenizer.encode(text)
    assert second.tokenizer.decode(plain.tokenizer.encode(text)) == text
    assert (second.tokenizer.bos_id, second.tokenizer.eos_id, second.tokenizer.stop_ids) == (
        plain.tokenizer.bos_id,
        plain.tokenizer.eos_id,
        plain.tokenizer.stop_ids,
    )
    gen = plain.generate(IDS, 5, stop_at_eos=False)
    assert second.generate(IDS, 5, stop_at_eos=False) == gen


def test_a_changed_gguf_file_makes_the_cache_stale_and_it_is_rebuilt(tmp_path, cache):
    path = _write(tmp_path / "m.gguf", seed=1)
    load_model(path, reuse=False)
    stamp = os.stat(path).st_mtime_ns
    _write(path, seed=2)  # same path and size, other weights
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    fresh = load_model(path, reuse=False)
    assert not _mapped(fresh.embedding)  # read from the GGUF file, not the stale cache
    np.testing.assert_array_equal(fresh.forward(IDS), load_model(path, reuse=False, cache_weights=False).forward(IDS))
    again = load_model(path, reuse=False)
    assert _mapped(again.embedding)
    np.testing.assert_array_equal(again.forward(IDS), fresh.forward(IDS))
    assert len(_files(cache)) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_cache_file_is_never_used_and_is_rebuilt(tmp_path, cache, damage):
    path = _write(tmp_path / "m.gguf")
    ref = load_model(path, reuse=False, cache_weights=False).forward(IDS)
    load_model(path, reuse=False)
    (f,) = _files(cache)
    raw = bytearray(f.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x40  # inside the last array
    elif damage == "truncate":
        raw = raw[: len(raw) - 64]
    else:
        raw[30] ^= 0x01  # inside the JSON header
    f.write_bytes(bytes(raw))
    rebuilt = load_model(path, reuse=False)
    assert not _mapped(rebuilt.embedding)
    np.testing.assert_array_equal(rebuilt.forward(IDS), ref)
    again = load_model(path, reuse=False)
    assert _mapped(again.embedding)
    np.testing.assert_array_equal(again.forward(IDS), ref)


def test_opt_out_by_argument_and_by_environment(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf")
    load_model(path, reuse=False, cache_weights=False)
    assert _files(cache) == []
    monkeypatch.setenv("ARRAYKV_WEIGHT_CACHE", "0")
    load_model(path, reuse=False)
    load_model(path, reuse=False)
    assert _files(cache) == []
    assert weight_cache.cache_location() is None


def test_default_location_is_under_the_arraykv_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("ARRAYKV_WEIGHT_CACHE", raising=False)
    monkeypatch.setenv("ARRAYKV_CACHE_DIR", str(tmp_path / "ak"))
    assert weight_cache.cache_location() == tmp_path / "ak" / "weights"


def test_an_unwritable_cache_directory_leaves_loading_as_it_was(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ARRAYKV_WEIGHT_CACHE", str(blocker / "weights"))
    path = _write(tmp_path / "m.gguf")
    m = load_model(path, reuse=False)
    np.testing.assert_array_equal(m.forward(IDS), load_model(path, reuse=False, cache_weights=False).forward(IDS))
    assert not list(tmp_path.glob("**/*.part"))


def test_a_model_without_tokenizer_and_a_later_load_with_one(tmp_path, cache):
    path = _write(tmp_path / "m.gguf")
    no_tok = load_model(path, reuse=False, tokenizer=False)
    assert no_tok.tokenizer is None
    # the cache holds the tokenizer all the same: a later load with one does not parse the file
    (f,) = _files(cache)
    meta, _ = weight_cache.read(f, weight_cache.identity(path, _version()))
    assert meta["tokenizer"] is not None
    with_tok = load_model(path, reuse=False)
    assert _mapped(with_tok.embedding)
    assert with_tok.tokenizer.encode("hello") == load_model(path, reuse=False, cache_weights=False).tokenizer.encode(
        "hello"
    )
    bare = _write(tmp_path / "bare.gguf", tokens=False)
    load_model(bare, reuse=False)
    assert load_model(bare, reuse=False).tokenizer is None


def test_cache_files_of_deleted_gguf_files_are_pruned(tmp_path, cache):
    gone = _write(tmp_path / "gone.gguf")
    load_model(gone, reuse=False)
    gone.unlink()
    kept = _write(tmp_path / "kept.gguf", dataclasses.replace(CFG, num_layers=1))
    load_model(kept, reuse=False)
    assert _files(cache) == [weight_cache.cache_file(cache, kept)]


def test_write_and_read_round_trip_every_dtype_and_empty_arrays(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")
    ident = weight_cache.identity(src, "v1")
    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous: written contiguous
        "f16": np.array([1.5, -2.0], np.float16),
        "i64": np.array([[7]], np.int64),
        "empty": np.zeros((0, 3), np.float32),
    }
    f = tmp_path / "c.akw"
    assert weight_cache.write(f, ident, {"k": [1, 2]}, arrays)
    meta, got = weight_cache.read(f, ident)
    assert meta == {"k": [1, 2]}
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype
        np.testing.assert_array_equal(got[k], a)
    assert weight_cache.read(f, weight_cache.identity(src, "v2")) is None
    with pytest.raises(TypeError, match="'obj'"):
        weight_cache.write(f, ident, {}, {"obj": np.array([None])})


@pytest.mark.slow
@pytest.mark.parametrize("name", [None, "gemma3-270m"])
def test_real_models_load_from_the_cache_with_bit_identical_logits(tmp_path, cache, name):
    plain = load_model(name, reuse=False, cache_weights=False, download=False, quiet=True)
    ids = plain.tokenizer.encode("The capital of France is")
    ref = plain.forward(ids)
    del plain
    load_model(name, reuse=False, download=False, quiet=True)
    cached = load_model(name, reuse=False, download=False, quiet=True)
    assert _mapped(cached.embedding)
    assert cached.tokenizer.encode("The capital of France is") == ids
    np.testing.assert_array_equal(cached.forward(ids), ref)
