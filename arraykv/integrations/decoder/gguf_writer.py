"""Writing a decoder GGUF file from a :class:`~arraykv.integrations.decoder.model_config.ModelConfig` and tensors.

The inverse of :func:`~arraykv.integrations.decoder.gguf_reader.read_gguf` for every supported architecture:
tests and examples build small models of any architecture with random weights
(:func:`~arraykv.integrations.decoder.weights.random_gguf_tensors`), write them here, and load
them with arraykv's decoder or with any other GGUF reader, to compare the two.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..common.optional import require
from .model_config import ModelConfig

__all__ = ["write_gguf"]


def write_gguf(
    path: str | os.PathLike,
    config: ModelConfig,
    tensors: dict,
    *,
    tokens: Sequence[str] | None = None,
    merges: Sequence[str] = (),
    tokenizer_pre: str = "smollm",
    eos_id: int = 0,
    meta: dict | None = None,
) -> str:
    """Write a GGUF file of ``config``'s architecture holding ``tensors`` (stored as float32).

    Parameters
    ----------
    path : str or PathLike
    config : ModelConfig
        Metadata written under ``{config.arch}.*``.
    tensors : dict of str to numpy.ndarray
        GGUF names to ``(out, in)`` arrays (Q/K rows in the GGUF order of the architecture).
    tokens : sequence of str, optional
        A byte-level BPE vocabulary (``gpt2`` model) with ``merges``; none by default.
    merges : sequence of str
    tokenizer_pre : str, default "smollm"
    eos_id : int, default 0
    meta : dict, optional
        ``GGUFWriter`` ``add_*`` method names to values, applied last (to override a field).

    Returns
    -------
    str
        The path written.
    """
    gguf = require("gguf")
    c = config
    w = gguf.GGUFWriter(str(path), c.arch)
    w.add_name(c.name)
    w.add_block_count(c.num_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.ffn_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_context_length(c.context_length)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_vocab_size(c.vocab_size)
    if c.head_dim * c.num_heads != c.hidden_size or c.arch != "llama":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_pre)
        w.add_token_list(list(tokens))
        w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        w.add_token_merges(list(merges))
        w.add_eos_token_id(eos_id)
    for name, value in (meta or {}).items():
        getattr(w, name)(value)

    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
