"""A tiny random transformers Llama for the tests of arraykv inside transformers (needs torch and transformers)."""

from __future__ import annotations

#: Vocabulary of :func:`tiny_llama`.
VOCAB = 256

#: The sizes of the tiny random models (config keyword arguments): 2 layers, GQA 4/2 heads,
#: head_dim 16, weights drawn 10x wider than transformers' default so that logits differ.
TINY_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
}


def tiny_llama(seed: int = 0):
    """A random Llama of :data:`TINY_SIZES`, weights drawn after ``torch.manual_seed(seed)``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_SIZES)).eval()
