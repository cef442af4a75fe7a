"""What the command line checks its arguments against: a GGUF model's header, read without its weights.

``--layer``, context lengths, draft layers and text lengths in tokens depend on the model. The
commands check them against :func:`model_header` before :func:`~arraykv.integrations.decoder.gguf_loading.
load_model` reads (and dequantizes) the weights: the metadata key/value section of the file is
read here with :mod:`struct` alone, and the tokenizer is built from it as the loader builds it
(:func:`~arraykv.integrations.decoder.tokenizer.tokenizer_from_gguf`). ``gguf.GGUFReader`` makes a
NumPy view of every array element of that section (about 100k for SmolLM2's vocabulary and
merges) and takes seconds; this reads SmolLM2's header in a fraction of one.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelHeader", "model_header", "load_model_of", "read_metadata"]

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Field:
    """One metadata value, with the ``contents()`` of ``gguf``'s reader fields."""

    def __init__(self, value: Any):
        self.value = value

    def contents(self) -> Any:
        return self.value


class _Metadata:
    """The ``fields`` mapping the tokenizer builder reads (as ``gguf.GGUFReader`` offers it)."""

    def __init__(self, values: dict):
        self.fields = {k: _Field(v) for k, v in values.items()}


def read_metadata(path: str | os.PathLike) -> dict:
    """The key/value metadata of a GGUF file (versions 2 and 3), without its tensors.

    Parameters
    ----------
    path : str or PathLike

    Returns
    -------
    dict of str to value
        Numbers as Python ``int``/``float``/``bool``, strings as ``str``, arrays as lists.

    Raises
    ------
    ValueError
        Not a GGUF file, another version, or a truncated or malformed header.
    """
    import numpy as np

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path} is not a GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
            (version,) = struct.unpack_from("<I", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
            (count,) = struct.unpack_from("<Q", buf, 16)
            pos = 24

            def take(fmt: str) -> Any:
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise ValueError(f"{path}: the metadata runs past the end of the file")
                (v,) = struct.unpack_from(fmt, buf, pos)
                pos += n
                return v

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                if pos + n > size:
                    raise ValueError(f"{path}: a metadata string runs past the end of the file")
                s = buf[pos : pos + n].decode("utf-8")
                pos += n
                return s

            def value(kind: int) -> Any:
                nonlocal pos
                if kind in _SCALARS:
                    return take("<" + _SCALARS[kind])
                if kind == _STRING:
                    return string()
                if kind != _ARRAY:
                    raise ValueError(f"{path}: unknown metadata type {kind}")
                item, n = take("<I"), take("<Q")
                if item in _SCALARS and item != 7:
                    dtype = np.dtype("<" + _SCALARS[item])
                    if pos + n * dtype.itemsize > size:
                        raise ValueError(f"{path}: a metadata array runs past the end of the file")
                    out = np.frombuffer(buf, dtype, n, pos).tolist()
                    pos += n * dtype.itemsize
                    return out
                return [value(item) for _ in range(n)]

            fields = {}
            for _ in range(count):
                key = string()
                fields[key] = value(take("<I"))
            return fields


@dataclass(frozen=True)
class ModelHeader:
    """What a GGUF model is, from its metadata alone.

    Attributes
    ----------
    path : pathlib.Path
        The file (a known model's name resolved, the default model found).
    architecture : str
        ``general.architecture``.
    num_layers, context_length, num_kv_heads, head_dim : int
    tokenizer : GGUFTokenizer or None
        Built from the metadata as the loader builds it; None when the file has none.
    """

    path: Path
    architecture: str
    num_layers: int
    context_length: int
    num_kv_heads: int
    head_dim: int
    tokenizer: Any


def model_header(model: str | None, *, quiet: bool = False) -> ModelHeader:
    """The header of ``--model``: a ``.gguf`` path, a known model's name, or None (the default).

    Parameters
    ----------
    model : str or None
        As :func:`~arraykv.integrations.decoder.gguf_loading.load_model` takes it; a known model not
        cached yet is fetched, as the command would fetch it.
    quiet : bool, default False

    Returns
    -------
    ModelHeader

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        ``model`` names no file.
    ValueError
        Not a GGUF file, an architecture the loader does not take, or sizes missing.
    """
    from .integrations.common.downloads import find_model, resolve_model
    from .integrations.decoder.architectures import ARCHITECTURES
    from .integrations.decoder.tokenizer import tokenizer_from_gguf

    known = resolve_model(model, quiet=quiet)
    path = known if known is not None else find_model(model, quiet=quiet)
    meta = read_metadata(path)
    name = meta.get("general.architecture")
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ValueError(
            f"{path} holds a {name!r} model; the supported architectures are {', '.join(sorted(ARCHITECTURES))}"
        )

    def size(key: str, default: Any = None) -> int:
        v = meta.get(f"{arch.name}.{key}", default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{path}: metadata field {arch.name}.{key} is {v!r}; it must be a positive integer")
        return v

    heads = size("attention.head_count")
    hidden = size("embedding_length")
    tok = tokenizer_from_gguf(_Metadata(meta)) if meta.get("tokenizer.ggml.model") is not None else None
    return ModelHeader(
        path=Path(path),
        architecture=str(name),
        num_layers=size("block_count"),
        context_length=size("context_length"),
        num_kv_heads=size("attention.head_count_kv", heads),
        head_dim=size("attention.key_length", hidden // heads),
        tokenizer=tok,
    )


def load_model_of(header: ModelHeader, *, quiet: bool = False) -> Any:
    """The model ``header`` describes, its weights loaded, with the tokenizer ``header`` built.

    The tokenizer is not built a second time (Gemma 3's 262k-token vocabulary takes seconds).

    Parameters
    ----------
    header : ModelHeader
    quiet : bool, default False

    Returns
    -------
    DecoderModel
        Not shared with :func:`~arraykv.integrations.decoder.gguf_loading.load_model`'s reuse (its
        ``tokenizer`` is set here).
    """
    from .integrations.decoder.gguf_loading import load_model

    model = load_model(header.path, tokenizer=False, quiet=quiet, reuse=False)
    model.tokenizer = header.tokenizer
    return model
