"""The prefix-store tests' decoder: two layers with random weights (also imported by the worker process)."""

from __future__ import annotations

from arraykv.integrations.decoder.model import DecoderModel, ModelConfig, random_gguf_tensors

#: A two-layer decoder with random weights: fast enough to prefill hundreds of tokens per test.
TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=101,
    context_length=1024,
    rope_theta=10000.0,
    rms_eps=1e-5,
    name="tiny-store",
)


def tiny_model(seed: int = 3):
    return DecoderModel.from_gguf_tensors(TINY, random_gguf_tensors(TINY, seed=seed))
