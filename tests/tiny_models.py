"""The tests' tiny models: decoder configurations of a few layers, and their builders with seeded random weights.

Each configuration is the one some tests were written for (its sizes, RoPE base and vocabulary);
two that differ in one size are two configurations, so that every test keeps testing what it did.
:func:`decoder` gives the NumPy decoder of a configuration, :func:`llama_onnx` a decoder's ONNX
graph as the project's exporter writes it, :func:`arch_config` a small model of any supported
architecture. :func:`hf_llama` and :func:`hf_gemma3` are random transformers models (they need
torch and transformers).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np

from arraykv.integrations.decoder.architectures import architecture, periodic_layer_types
from arraykv.integrations.decoder.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]

# -- Llama configurations ------------------------------------------------------------------------

#: The GGUF reading tests' Llama: 2 layers, 4 query heads over 2 KV heads of 8.
GGUF_LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=60,
    context_length=64,
    rope_theta=50000.0,
    rms_eps=1e-5,
)
#: :data:`GGUF_LLAMA` with a vocabulary of 110: :func:`byte_tokens`' 99 tokens and fillers.
GGUF_LLAMA_TOKENIZED = dataclasses.replace(GGUF_LLAMA, vocab_size=110)
#: :data:`GGUF_LLAMA` with 3 layers: a failing layer between two others (the decoder step tests).
STEP_LLAMA = dataclasses.replace(GGUF_LLAMA, num_layers=3)

#: The NumPy decoder tests' Llama: 6 query heads over 2 KV heads of 8, an odd vocabulary.
DECODER_LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=48,
    ffn_size=80,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=97,
    context_length=96,
    rope_theta=10000.0,
    rms_eps=1e-5,
    name="tiny",
)
#: :data:`DECODER_LLAMA` with 4 layers and 256 positions: a target for the speculative decoding tests.
SPECULATIVE_LLAMA = dataclasses.replace(DECODER_LLAMA, num_layers=4, context_length=256)

#: The ONNX Runtime graph tests' Llama: heads of 64, the size ONNX Runtime's attention kernels take.
ONNX_LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=128,
    ffn_size=192,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=97,
    context_length=512,
    rope_theta=10000.0,
    rms_eps=1e-5,
    name="tiny",
)

#: The precompile tests' Llama: 3 layers of heads of 64 (the geometry the kernels are compiled for).
PRECOMPILE_LLAMA = ModelConfig(
    num_layers=3,
    hidden_size=32,
    ffn_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=60,
    context_length=256,
    rope_theta=10000.0,
    rms_eps=1e-5,
)

#: The evaluation metrics tests' Llama.
EVAL_LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=71,
    context_length=128,
    rope_theta=10000.0,
    rms_eps=1e-5,
)


class CharTokenizer:
    """One token per character of newline + printable ASCII; the last id is end-of-sequence."""

    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    eos_id = len(chars)

    def encode(self, text):
        return [self.chars.index(ch) for ch in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


#: :data:`EVAL_LLAMA` with :class:`CharTokenizer`'s vocabulary and 512 positions (the long-context tests).
LONG_LLAMA = dataclasses.replace(EVAL_LLAMA, vocab_size=len(CharTokenizer.chars) + 1, context_length=512)

#: A byte-level vocabulary of printable ASCII with newline and space (``Ċ``, ``Ġ``) and two merges' results.
TEXT_TOKENS = ["<|end|>", "Ċ", "Ġ"] + [chr(c) for c in range(33, 127)] + ["ĠT", "he"]
#: The command-line tests' Llama (:func:`text_llama_gguf`): :data:`GGUF_LLAMA`'s sizes, :data:`TEXT_TOKENS`,
#: 512 positions.
TEXT_LLAMA = dataclasses.replace(GGUF_LLAMA, vocab_size=len(TEXT_TOKENS), context_length=512, rope_theta=10000.0)

#: The interrupted-call tests' Llama: 3 layers of heads of 16.
INTERRUPT_LLAMA = ModelConfig(
    num_layers=3,
    hidden_size=32,
    ffn_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=60,
    context_length=128,
    rope_theta=50000.0,
    rms_eps=1e-5,
    name="tiny-llama",
)
#: :data:`INTERRUPT_LLAMA` with 2 layers of heads of 64, for its ONNX graph.
INTERRUPT_ONNX_LLAMA = dataclasses.replace(
    INTERRUPT_LLAMA, num_layers=2, head_dim=64, hidden_size=128, name="tiny-onnx"
)

#: The prefix-store tests' Llama: fast enough to prefill hundreds of tokens per test.
STORE_LLAMA = ModelConfig(
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

# -- Gemma 3 configurations (sliding-window and global layers) ----------------------------------

#: Gemma 3's layout in small: layers 0-4 slide over 6 tokens, layer 5 attends to everything.
INTERRUPT_GEMMA = ModelConfig(
    num_layers=6,
    hidden_size=32,
    ffn_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=60,
    context_length=128,
    rope_theta=1e6,
    rms_eps=1e-6,
    arch="gemma3",
    layer_types=periodic_layer_types(6, 6),
    sliding_window=6,
    name="tiny-gemma",
)

#: The window cache tests' Gemma 3: two layers sliding over 5 tokens, then a global one.
WINDOW_GEMMA = ModelConfig(
    num_layers=3,
    hidden_size=32,
    ffn_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=100,
    context_length=256,
    rope_theta=1e4,
    rms_eps=1e-6,
    arch="gemma3",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    sliding_window=5,
)

# -- every architecture ---------------------------------------------------------------------------

#: Head sizes transformers can read back for each architecture: it derives llama's and qwen2's
#: from hidden / heads, takes qwen3's default (128), and reads gemma3's from the file.
ARCH_HEAD_DIM = {"llama": 16, "qwen2": 16, "qwen3": 128, "gemma3": 32}


def arch_config(arch: str, **over) -> ModelConfig:
    """A small model of architecture ``arch`` (7 layers for a hybrid one, else 2); ``over`` replaces fields."""
    hybrid = architecture(arch).sliding_period
    n = 7 if hybrid else 2
    kw = dict(
        num_layers=n,
        hidden_size=64,
        ffn_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=ARCH_HEAD_DIM[arch],
        vocab_size=128,
        context_length=256,
        rope_theta=1e6 if hybrid else 1e4,
        rms_eps=1e-6,
        arch=arch,
        name=f"tiny-{arch}",
    )
    if hybrid:
        kw.update(layer_types=periodic_layer_types(n, hybrid), sliding_window=6)
    kw.update(over)
    return ModelConfig(**kw)


# -- builders -------------------------------------------------------------------------------------


def decoder(config: ModelConfig, seed: int, *, tokenizer=None):
    """The NumPy decoder of ``config`` with random weights (``random_gguf_tensors(config, seed)``)."""
    from arraykv.integrations.decoder.model import DecoderModel, random_gguf_tensors

    return DecoderModel.from_gguf_tensors(config, random_gguf_tensors(config, seed=seed), tokenizer=tokenizer)


def store_model(seed: int = 3):
    """The prefix-store tests' decoder (:data:`STORE_LLAMA`); also built by their worker processes."""
    return decoder(STORE_LLAMA, seed)


def store_prompt(n: int, seed: int = 0) -> list:
    """``n`` token ids of :data:`STORE_LLAMA`'s vocabulary, drawn by NumPy's generator of ``seed``."""
    return np.random.default_rng(seed).integers(0, STORE_LLAMA.vocab_size, n).tolist()


def byte_tokens(n: int) -> list:
    """``n`` tokens: ``"<|end|>"``, printable ASCII, ``"Ġ"``, the merges' results (``he``, ``ll``,
    ``hell``; see :data:`MERGES`), then fillers ``x0``, ``x1``, ... (the first ``n`` of them if fewer)."""
    base = ["<|end|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "he", "ll", "hell"]
    return base[:n] if n <= len(base) else base + [f"x{i}" for i in range(n - len(base))]


#: The merges of :func:`byte_tokens`' vocabulary.
MERGES = ["h e", "l l", "he ll"]


def text_llama_gguf(path):
    """A GGUF file at ``path`` of :data:`TEXT_LLAMA` with random weights (seed 2) and the byte-level
    vocabulary :data:`TEXT_TOKENS`: text in, text out; skips the test where gguf or tokenizers is missing."""
    import pytest

    pytest.importorskip("gguf", reason="extra [model] not installed")
    pytest.importorskip("tokenizers", reason="extra [model] not installed")
    from arraykv.integrations.decoder.gguf_writer import write_gguf
    from arraykv.integrations.decoder.model import random_gguf_tensors

    write_gguf(path, TEXT_LLAMA, random_gguf_tensors(TEXT_LLAMA, seed=2), tokens=TEXT_TOKENS, merges=["Ġ T", "h e"])
    return path


def llama_onnx(model):
    """The ONNX graph of NumPy decoder ``model`` as ``examples/export_smollm2_onnx.py`` builds it (needs onnx)."""
    spec = importlib.util.spec_from_file_location("export_smollm2_onnx", ROOT / "examples" / "export_smollm2_onnx.py")
    exporter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exporter)
    return exporter.build_llama_onnx(model)


# -- transformers models --------------------------------------------------------------------------

#: Vocabulary of :func:`hf_llama` and :func:`hf_gemma3`.
HF_VOCAB = 256

#: The sizes of the tiny random transformers models (config keyword arguments): 2 layers, GQA 4/2
#: heads, head_dim 16, weights drawn 10x wider than transformers' default so that logits differ.
HF_SIZES = {
    "vocab_size": HF_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
}


def hf_llama(seed: int = 0):
    """A random transformers Llama of :data:`HF_SIZES`, weights drawn after ``torch.manual_seed(seed)``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).eval()


def hf_gemma3_text_config():
    """A transformers Gemma 3 text config of :data:`HF_SIZES`: a sliding-window layer (window 8), then a global one;
    skips the test where this transformers has no Gemma 3."""
    import pytest
    import transformers

    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip("this transformers has no Gemma 3")
    return transformers.Gemma3TextConfig(
        **HF_SIZES, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    )


def hf_gemma3(seed: int = 0):
    """A random transformers Gemma 3 of :func:`hf_gemma3_text_config`, weights drawn after
    ``torch.manual_seed(seed)``."""
    import torch
    import transformers

    cfg = hf_gemma3_text_config()
    torch.manual_seed(seed)
    return transformers.Gemma3ForCausalLM(cfg).eval()


#: The random transformers models by architecture, each a function of the seed.
HF_MODELS = {"llama": hf_llama, "gemma3": hf_gemma3}


def hf_ids(batch: int, n: int, seed: int = 1, *, low: int = 0):
    """Token ids ``(batch, n)`` in ``[low, HF_VOCAB)`` drawn by a torch generator seeded with ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, HF_VOCAB, (batch, n), generator=g)
