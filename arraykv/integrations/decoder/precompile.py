"""Compile the CPU kernels a cache method needs in a separate process while a model loads.

The Numba kernels compile on their first call and are cached on disk; on a fresh install the
first answer waits for them (minutes on a busy two-core machine) after the model has loaded.
:func:`start` runs that compilation in a child process, on another core, as soon as a model's
config is known: the child builds a tiny model of the same architecture and geometry (a copy of
the config with a few layers, a small hidden size and vocabulary, random weights) and answers a
short prompt with each method, which compiles exactly the kernels and signatures the real
model's first answer calls, and fills Numba's disk cache. :func:`arraykv.ops.pending.wait`
(called by :meth:`~arraykv.integrations.decoder.model.DecoderModel.make_cache` for its method) waits
for the child,
so the main process then loads the kernels from the cache instead of compiling them a second
time beside it.

Once a child has finished, a stamp file says so (``kernels/<key>.ok`` under ``$ARRAYKV_CACHE_DIR``
or ``~/.cache/arraykv``), and later processes start none: the key covers the method, the
kernel-relevant part of the config, the Numba cache directory, the versions of Python and Numba,
the CPU, and the size and modification time of every kernel source file, so any change that
makes Numba recompile also makes a new key. Two processes may compile at once (Numba writes its
cache files atomically); a lock file keeps a second child for the same key from starting while
one runs. A child that fails or is killed changes nothing but the time: the main process then
compiles what it needs itself, as without this module.

``ARRAYKV_PRECOMPILE`` chooses the methods (comma-separated; ``0``, ``off`` or ``none`` for
none); :func:`~arraykv.integrations.decoder.gguf_loading.load_model` takes them as ``precompile=``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ...ops import pending
from .model_config import ModelConfig

__all__ = ["DEFAULT_METHODS", "Precompile", "default_methods", "kernel_key", "start", "main"]

#: Methods compiled ahead when neither the caller nor ``ARRAYKV_PRECOMPILE`` says otherwise.
DEFAULT_METHODS = ("pqo4",)
_OFF = ("", "0", "off", "none", "no", "false")
#: A lock older than this is taken to be left by a child that died.
_STALE_LOCK_S = 1800.0


def default_methods() -> tuple:
    """The methods to compile ahead: ``$ARRAYKV_PRECOMPILE`` (comma-separated) or :data:`DEFAULT_METHODS`."""
    env = os.environ.get("ARRAYKV_PRECOMPILE")
    if env is None:
        return DEFAULT_METHODS
    if env.strip().lower() in _OFF:
        return ()
    return tuple(m.strip() for m in env.split(",") if m.strip())


def _stamp_dir() -> Path:
    base = os.environ.get("ARRAYKV_CACHE_DIR")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "arraykv") / "kernels"


def _kernel_sources() -> list:
    """``(relative path, size, mtime_ns)`` of every kernel source file (Numba keys its cache by them)."""
    root = Path(__file__).resolve().parents[2]  # the arraykv package
    out = []
    for sub in ("ops", "caches", "quant", "attention", "storage"):
        for f in sorted((root / sub).rglob("*.py")):
            st = f.stat()
            out.append((str(f.relative_to(root)), st.st_size, st.st_mtime_ns))
    return out


def _small_config(config: ModelConfig) -> ModelConfig:
    """``config`` with its attention geometry and layer kinds, but few layers, a small hidden size and vocabulary."""
    kinds = config.kinds
    n = next((i + 1 for i in range(len(kinds)) if set(kinds[: i + 1]) == set(kinds)), len(kinds))
    return dataclasses.replace(
        config,
        num_layers=n,
        layer_types=tuple(config.layer_types[:n]),
        hidden_size=64,
        ffn_size=64,
        vocab_size=64,
        name="precompile",
    )


def kernel_key(config: ModelConfig, method: str) -> str:
    """The key of ``method``'s compiled kernels for ``config`` on this machine and install (hex string).

    Parameters
    ----------
    config : ModelConfig
    method : str

    Returns
    -------
    str
        SHA-256 over the method, the architecture, the attention geometry (heads, KV heads,
        head size, layer kinds, sliding window), the Numba cache directory and thread count,
        the versions of Python and Numba, the CPU, and every kernel source file's size and
        modification time.
    """
    import numba

    # its settings are module attributes set from the environment at import time, unknown to a type checker
    nb_config = importlib.import_module("numba.core.config")

    c = config
    parts = {
        "method": method,
        "geometry": [c.arch, c.num_heads, c.num_kv_heads, c.head_dim, sorted(set(c.kinds)), c.sliding_window],
        "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR", ""),
        "threads": nb_config.NUMBA_NUM_THREADS,
        "python": sys.version,
        "numba": numba.__version__,
        "cpu": nb_config.CPU_NAME or _host_cpu(),
        "sources": _kernel_sources(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _host_cpu() -> str:
    ll = importlib.import_module("llvmlite.binding")  # llvmlite has no type information

    return f"{ll.get_host_cpu_name()}:{ll.get_host_cpu_features().flatten()}"


class Precompile:
    """A running child process compiling the kernels of ``methods``.

    Attributes
    ----------
    methods : tuple of str
    process : subprocess.Popen
    """

    def __init__(self, methods: tuple, process: subprocess.Popen) -> None:
        self.methods = methods
        self.process = process

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the child; True when it finished and compiled everything, False otherwise."""
        try:
            return self.process.wait(timeout) == 0
        except subprocess.TimeoutExpired:
            return False

    def done(self) -> bool:
        """Whether the child has ended."""
        return self.process.poll() is not None


def start(config: ModelConfig, methods: Sequence[str] | None = None) -> Precompile | None:
    """Start a child process compiling the kernels of ``methods`` for ``config``, unless already done.

    Parameters
    ----------
    config : ModelConfig
        The model's config (its architecture, heads, head size and layer kinds matter).
    methods : sequence of str, optional
        Cache methods; :func:`default_methods` when None.

    Returns
    -------
    Precompile or None
        None when there is nothing to do: no methods, every method's stamp present, or another
        process's child already compiling them. The child is registered with
        :func:`arraykv.ops.pending.register`.
    """
    methods = default_methods() if methods is None else tuple(methods)
    if not methods:
        return None
    try:
        keys = {m: kernel_key(config, m) for m in methods}
    except ImportError:  # no Numba: nothing to compile
        return None
    folder = _stamp_dir()
    todo = tuple(m for m in methods if not (folder / f"{keys[m]}.ok").exists())
    if not todo:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    locks = [_take_lock(folder / f"{keys[m]}.lock") for m in todo]
    todo = tuple(m for m, ok in zip(todo, locks) if ok)
    if not todo:
        return None
    cfg = dataclasses.asdict(config)
    cfg["layer_types"] = list(cfg["layer_types"])
    cmd = [sys.executable, "-m", __name__, json.dumps(cfg), str(folder), *(f"{m}={keys[m]}" for m in todo)]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        for m in todo:
            _drop_lock(folder / f"{keys[m]}.lock")
        return None
    job = Precompile(todo, proc)
    pending.register(job)
    return job


def _take_lock(path: Path) -> bool:
    """Create lock file ``path`` (False when a fresh one exists: another child compiles that key)."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                age = time.time() - path.stat().st_mtime
            except OSError:
                continue
            if age < _STALE_LOCK_S:
                return False
            _drop_lock(path)
            continue
        except OSError:
            return False
        os.close(fd)
        return True
    return False


def _drop_lock(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _stamp(path: Path) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    with contextlib.suppress(OSError):
        tmp.write_text("ok\n")
        os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: ``python -m arraykv.integrations.decoder.precompile CONFIG_JSON STAMP_DIR METHOD=KEY ...``.

    Builds the small model of the config (:func:`kernel_key`'s) and answers a short prompt
    with each method; writes each method's stamp when it succeeded and drops its lock.
    """
    import numpy as np

    from .model import DecoderModel
    from .weights import random_gguf_tensors

    args = list(sys.argv[1:] if argv is None else argv)
    cfg = json.loads(args[0])
    cfg["layer_types"] = tuple(cfg["layer_types"])
    small = _small_config(ModelConfig(**cfg))
    folder = Path(args[1])
    model = DecoderModel.from_gguf_tensors(small, random_gguf_tensors(small, seed=0))
    prompt = [int(i) for i in np.arange(1, 7) % small.vocab_size]
    failed = 0
    for item in args[2:]:
        method, key = item.split("=", 1)
        try:
            model.generate(prompt, 3, cache=model.make_cache(method), stop_at_eos=False)
        except Exception:  # noqa: BLE001 - the main process compiles (and reports) what failed here
            failed += 1
        else:
            _stamp(folder / f"{key}.ok")
        finally:
            _drop_lock(folder / f"{key}.lock")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
