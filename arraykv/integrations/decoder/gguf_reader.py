"""Reading a decoder GGUF model file (Llama, Qwen 2/3, Gemma 3).

:func:`read_gguf` dequantizes every tensor to float32 with the ``gguf`` package and returns the
model hyper-parameters from the metadata. Finding or fetching the file is
:mod:`arraykv.integrations.common.downloads`' job.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..common.downloads import check_model_file
from ..common.optional import require
from .model_config import ModelConfig

__all__ = ["read_gguf"]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def read_gguf(path: str | os.PathLike, *, on_config: Callable[[ModelConfig], None] | None = None) -> tuple:
    """Read a decoder GGUF file: its config, float32 tensors and raw metadata fields.

    Parameters
    ----------
    path : str or PathLike
    on_config : callable, optional
        Called with the config as soon as the metadata is read, before the tensors are
        dequantized (the longer part), so that work needing only the config (compiling the
        kernels of its geometry) can start.

    Returns
    -------
    config : ModelConfig
    tensors : dict of str to numpy.ndarray (float32)
        GGUF tensor name to array in the usual ``(out_features, in_features)`` layout,
        dequantized. Q/K rows are still in the GGUF order.
    reader : gguf.GGUFReader
        For the tokenizer metadata.

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        Missing file, or a directory.
    ValueError
        Not a GGUF file, a truncated one, an architecture that is not supported
        (:data:`~arraykv.integrations.decoder.architectures.ARCHITECTURES`), metadata that cannot
        describe a model (a zero or negative size, ``head_count`` not a multiple of
        ``head_count_kv``, an odd head size, a non-finite RoPE base), or a tensor missing or
        of a shape the metadata contradicts.
    """
    gguf = require("gguf")

    from .architectures import ARCHITECTURES, periodic_layer_types

    p = Path(path)
    check_model_file(p)
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as exc:  # the gguf package raises ValueError, struct errors, IndexError...
        raise ValueError(
            f"{p} is not a readable GGUF file ({type(exc).__name__}: {exc}); if it was downloaded, "
            "delete it and run again to fetch it anew"
        ) from exc
    arch_name = _field(reader, "general.architecture")
    arch = ARCHITECTURES.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None:
        raise ValueError(
            f"{p} holds a {arch_name!r} model; the supported architectures are {', '.join(sorted(ARCHITECTURES))} "
            "(Llama, SmolLM, Mistral-style, Qwen 2/2.5/3 and Gemma 3 decoders)"
        )
    pre = arch.name

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{pre}.{key}", default)

    def need(key: str) -> Any:
        v = get(key)
        if v is None:
            raise ValueError(f"{p} lacks the metadata field {pre}.{key}; the file is incomplete")
        return v

    def size(key: str, value: Any) -> int:
        """A metadata size as a positive int, or a ValueError naming the field."""
        try:
            n = operator.index(value)
        except TypeError:
            n = None
        if n is None or isinstance(value, bool) or n < 1:
            raise ValueError(f"{p}: metadata field {pre}.{key} is {value!r}; it must be a positive integer")
        return int(n)

    hidden = size("embedding_length", need("embedding_length"))
    heads = size("attention.head_count", need("attention.head_count"))
    kv_heads = size("attention.head_count_kv", get("attention.head_count_kv", heads))
    if heads % kv_heads != 0:
        raise ValueError(f"{p}: head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    key_length = get("attention.key_length")
    if key_length is None and hidden % heads:
        raise ValueError(
            f"{p}: embedding_length {hidden} is not a multiple of head_count {heads} and "
            f"{pre}.attention.key_length is absent, so the head size is unknown"
        )
    head_dim = size("attention.key_length", hidden // heads if key_length is None else key_length)
    if head_dim % 2:
        raise ValueError(f"{p}: the head size {head_dim} is odd; RoPE rotates pairs of channels")
    value_length = get("attention.value_length")
    if value_length is not None and size("attention.value_length", value_length) != head_dim:
        raise ValueError(
            f"{p}: value heads of {value_length} channels differ from key heads of {head_dim}; not supported"
        )
    num_layers = size("block_count", need("block_count"))
    ffn = size("feed_forward_length", need("feed_forward_length"))
    context = size("context_length", get("context_length", 2048))
    theta = _real(p, f"{pre}.rope.freq_base", get("rope.freq_base", 10000.0), positive=True)
    eps = _real(
        p, f"{pre}.attention.layer_norm_rms_epsilon", get("attention.layer_norm_rms_epsilon", 1e-5), positive=False
    )
    scaling = get("rope.scaling.type")
    if (
        scaling not in (None, "none")
        and _real(p, f"{pre}.rope.scaling.factor", get("rope.scaling.factor", 1.0), positive=True) != 1.0
    ):
        raise ValueError(f"{p}: RoPE scaling {scaling!r} is not supported yet")
    window = get("attention.sliding_window")
    layer_types: tuple = ()
    if arch.sliding_period and window is not None:
        window = size("attention.sliding_window", window)
        layer_types = periodic_layer_types(num_layers, arch.sliding_period)
    else:
        window = 0
    emb_info = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb_info is None:
        raise ValueError(f"{p} has no token_embd.weight tensor; the file is incomplete")
    # GGUF lists dimensions fastest first: (hidden, vocab) for the (vocab, hidden) embedding
    vocab = size("vocab_size", get("vocab_size", int(emb_info.shape[-1])))
    cfg = ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_size=ffn,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=context,
        rope_theta=theta,
        rms_eps=eps,
        name=str(_field(reader, "general.name", arch.name)),
        arch=arch.name,
        layer_types=layer_types,
        sliding_window=window,
    )
    if on_config is not None:
        on_config(cfg)
    tensors: dict = {}
    for t in reader.tensors:
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"tensor {t.name} of {p} has the unsupported type {t.tensor_type.name}: {exc}") from exc
        tensors[t.name] = np.ascontiguousarray(a, dtype=np.float32)
    from .weights import tensor_shapes

    for name, shape in tensor_shapes(cfg).items():
        a = tensors.get(name)
        if a is None:
            raise ValueError(f"{p} lacks tensor {name!r}; the file is incomplete or not a {arch.name} model")
        if tuple(a.shape) != shape:
            raise ValueError(f"{p}: tensor {name!r} has shape {tuple(a.shape)}, but the metadata makes it {shape}")
    head = tensors.get("output.weight")
    if head is not None and tuple(head.shape) != (vocab, hidden):
        raise ValueError(
            f"{p}: tensor 'output.weight' has shape {tuple(head.shape)}, but the metadata makes it {(vocab, hidden)}"
        )
    return cfg, tensors, reader


def _real(p: Path, key: str, value: Any, *, positive: bool) -> float:
    """A metadata number as a finite float (``> 0`` or ``>= 0``), or a ValueError naming the field."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if isinstance(value, bool) or not math.isfinite(x) or x < 0.0 or (positive and x == 0.0):
        raise ValueError(
            f"{p}: metadata field {key} is {value!r}; it must be a finite number {'> 0' if positive else '>= 0'}"
        )
    return x
