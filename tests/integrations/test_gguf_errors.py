"""GGUF files whose metadata cannot describe a model, and paths that are not files: clear errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")

from arraykv.integrations.common.downloads import find_model  # noqa: E402
from arraykv.integrations.decoder.gguf_loading import load_model  # noqa: E402
from arraykv.integrations.decoder.gguf_reader import read_gguf  # noqa: E402
from arraykv.integrations.decoder.model import random_gguf_tensors, unpermute_qk  # noqa: E402

from tiny_models import GGUF_LLAMA as CFG  # noqa: E402


def _write(path, meta=None, tensors=None):
    """A small Llama GGUF whose metadata fields ``meta`` (GGUFWriter ``add_*`` names) override CFG's."""
    fields = {
        "block_count": CFG.num_layers,
        "embedding_length": CFG.hidden_size,
        "feed_forward_length": CFG.ffn_size,
        "head_count": CFG.num_heads,
        "head_count_kv": CFG.num_kv_heads,
        "context_length": CFG.context_length,
        "rope_freq_base": CFG.rope_theta,
        "layer_norm_rms_eps": CFG.rms_eps,
    }
    fields.update(meta or {})
    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in fields.items():
        if value is not None:
            getattr(w, "add_" + name)(value)
    for name, a in (random_gguf_tensors(CFG) if tensors is None else tensors).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "meta,match",
    [
        ({"head_count": 0}, r"llama\.attention\.head_count is 0; it must be a positive integer"),
        ({"head_count_kv": 0}, r"llama\.attention\.head_count_kv is 0"),
        ({"head_count_kv": 3}, "head_count 4 is not a multiple of head_count_kv 3"),
        ({"embedding_length": 0}, r"llama\.embedding_length is 0"),
        ({"block_count": 0}, r"llama\.block_count is 0"),
        ({"feed_forward_length": 0}, r"llama\.feed_forward_length is 0"),
        ({"context_length": 0}, r"llama\.context_length is 0"),
        ({"head_count": 5, "head_count_kv": 5}, "embedding_length 32 is not a multiple of head_count 5"),
        ({"key_length": 0}, r"llama\.attention\.key_length is 0"),
        ({"key_length": 7}, "head size 7 is odd"),
        ({"rope_freq_base": float("nan")}, r"llama\.rope\.freq_base is nan"),
        ({"rope_freq_base": 0.0}, r"llama\.rope\.freq_base is 0\.0; it must be a finite number > 0"),
        ({"layer_norm_rms_eps": -1.0}, r"layer_norm_rms_epsilon is -1\.0"),
        (
            {"key_length": 16},
            r"tensor 'blk\.0\.attn_q\.weight' has shape \(32, 32\), but the metadata makes it \(64, 32\)",
        ),
        ({"feed_forward_length": 40}, r"'blk\.0\.ffn_gate\.weight' has shape \(48, 32\).*\(40, 32\)"),
    ],
)
def test_metadata_that_cannot_describe_a_model_is_a_value_error(tmp_path, meta, match):
    path = _write(tmp_path / "m.gguf", meta)
    with pytest.raises(ValueError, match=match):
        read_gguf(path)
    with pytest.raises(ValueError, match=match):
        load_model(path, reuse=False)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    tensors = random_gguf_tensors(CFG)
    tensors["blk.1.ffn_norm.weight"] = tensors["blk.1.ffn_norm.weight"][:-1].copy()
    path = _write(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_norm\.weight' has shape \(31,\).*\(32,\)"):
        read_gguf(path)
    tensors = random_gguf_tensors(CFG)
    tensors["output.weight"] = np.zeros((CFG.vocab_size - 1, CFG.hidden_size), np.float32)
    path = _write(tmp_path / "h.gguf", tensors=tensors)
    with pytest.raises(ValueError, match="'output.weight'"):
        read_gguf(path)


def test_a_valid_file_still_loads(tmp_path):
    cfg, _, _ = read_gguf(_write(tmp_path / "ok.gguf", {"key_length": 8}))
    assert cfg == dataclasses.replace(CFG, name=cfg.name, rms_eps=cfg.rms_eps)  # eps is stored as float32
    assert cfg.rms_eps == pytest.approx(CFG.rms_eps)


def test_a_directory_is_named_as_a_directory(tmp_path):
    for call in (lambda: find_model(tmp_path), lambda: read_gguf(tmp_path), lambda: load_model(tmp_path)):
        with pytest.raises(IsADirectoryError, match="is a directory, not a file"):
            call()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")


def test_unpermute_qk_refuses_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError, match="does not split into 3 heads"):
        unpermute_qk(np.zeros((32, 8), np.float32), 3)
    with pytest.raises(ValueError, match="even size"):
        unpermute_qk(np.zeros((12, 8), np.float32), 4)
