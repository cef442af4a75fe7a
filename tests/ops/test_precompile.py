"""Compiling a method's kernels in a child process while a model loads (arraykv.integrations.decoder.precompile).

The slow test runs two children at once into one empty Numba cache directory and then checks
that a new process answering with the same method and geometry compiles none of arraykv's
kernels. The others check what starts a child and what waits for one, with real processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("numba")

from arraykv.integrations.decoder import precompile  # noqa: E402
from arraykv.ops import pending  # noqa: E402

from tiny_models import PRECOMPILE_LLAMA as CFG  # noqa: E402


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYKV_CACHE_DIR", str(tmp_path / "ak"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    return tmp_path


def test_methods_come_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("ARRAYKV_PRECOMPILE", raising=False)
    assert precompile.default_methods() == ("pqo4",)
    monkeypatch.setenv("ARRAYKV_PRECOMPILE", "int4, pqo3")
    assert precompile.default_methods() == ("int4", "pqo3")
    for off in ("0", "off", "none", ""):
        monkeypatch.setenv("ARRAYKV_PRECOMPILE", off)
        assert precompile.default_methods() == ()
    assert precompile.start(CFG, ()) is None


def test_the_key_follows_what_changes_the_compiled_code(dirs, monkeypatch):
    key = precompile.kernel_key(CFG, "pqo4")
    assert key == precompile.kernel_key(CFG, "pqo4")
    assert key == precompile.kernel_key(dataclasses.replace(CFG, num_layers=30, vocab_size=999), "pqo4")
    assert key != precompile.kernel_key(CFG, "int4")
    assert key != precompile.kernel_key(dataclasses.replace(CFG, head_dim=128), "pqo4")
    assert key != precompile.kernel_key(dataclasses.replace(CFG, arch="qwen2"), "pqo4")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(dirs / "elsewhere"))
    assert key != precompile.kernel_key(CFG, "pqo4")


def test_the_key_covers_the_kernel_sources_of_the_package():
    import arraykv.ops.codecs

    sources = {path for path, _, _ in precompile._kernel_sources()}
    assert "ops/codecs.py" in sources and arraykv.ops.codecs.__file__.endswith(os.path.join("ops", "codecs.py"))
    assert {path.split("/")[0] for path in sources} == {"ops", "caches", "quant", "attention", "storage"}


def test_the_small_model_keeps_every_layer_kind_and_the_attention_geometry():
    cfg = dataclasses.replace(
        CFG, num_layers=8, layer_types=("sliding_attention",) * 5 + ("full_attention",) * 3, sliding_window=16
    )
    small = precompile._small_config(cfg)
    assert small.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (small.num_heads, small.num_kv_heads, small.head_dim, small.sliding_window) == (4, 2, 64, 16)


def test_no_child_when_compiled_before_or_while_another_process_compiles(dirs):
    folder = dirs / "ak" / "kernels"
    folder.mkdir(parents=True)
    (folder / f"{precompile.kernel_key(CFG, 'pqo4')}.ok").write_text("ok\n")
    assert precompile.start(CFG, ["pqo4"]) is None  # stamped: compiled before
    lock = folder / f"{precompile.kernel_key(CFG, 'int4')}.lock"
    lock.write_text("")
    assert precompile.start(CFG, ["int4"]) is None  # a fresh lock: another child compiles it
    old = time.time() - 2 * precompile._STALE_LOCK_S
    os.utime(lock, (old, old))
    job = precompile.start(CFG, ["int4"])  # a stale lock is taken over
    try:
        assert job is not None and job.methods == ("int4",)
    finally:
        if job is not None:
            job.process.kill()
            job.process.wait()
            pending.wait()


def _sleeper(seconds: float, methods: tuple) -> precompile.Precompile:
    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    return precompile.Precompile(methods, proc)


def test_wait_waits_only_for_the_children_of_that_method():
    slow = _sleeper(3.0, ("pqo4",))
    pending.register(slow)
    try:
        t = time.perf_counter()
        pending.wait("int4")
        assert time.perf_counter() - t < 1.0 and not slow.done()
        assert "pqo4" in pending.pending_methods()
        pending.wait("pqo4")
        assert slow.done() and "pqo4" not in pending.pending_methods()
    finally:
        slow.process.kill()
        pending.wait()


def test_a_failed_child_is_not_an_error(dirs):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    job = precompile.Precompile(("pqo4",), proc)
    pending.register(job)
    pending.wait("pqo4")
    assert job.wait() is False


def test_load_model_checks_precompile():
    pytest.importorskip("gguf")
    from arraykv.integrations.decoder.gguf_loading import load_model

    with pytest.raises(TypeError, match="precompile"):
        load_model("nowhere.gguf", precompile="pqo4")


_CHECK = textwrap.dedent(
    """
    import json, sys
    from numba.core import event
    from arraykv.integrations.decoder.model import DecoderModel
    from arraykv.integrations.decoder.weights import random_gguf_tensors
    from arraykv.integrations.decoder.model_config import ModelConfig
    from arraykv.integrations.decoder.precompile import _small_config

    seen = []

    class L(event.Listener):
        def on_start(self, ev):
            py = getattr(ev.data.get("dispatcher"), "py_func", None)
            if getattr(py, "__module__", "").startswith("arraykv"):
                seen.append(py.__qualname__)

        def on_end(self, ev):
            pass

    event.register("numba:compile", L())
    cfg = json.loads(sys.argv[1])
    cfg["layer_types"] = tuple(cfg["layer_types"])
    small = _small_config(ModelConfig(**cfg))
    model = DecoderModel.from_gguf_tensors(small, random_gguf_tensors(small, seed=1))
    model.generate([3, 1, 4, 1, 5], 4, cache=model.make_cache(sys.argv[2]), stop_at_eos=False)
    print(json.dumps(seen))
    """
)


@pytest.mark.slow
def test_two_children_at_once_fill_the_cache_and_a_new_process_compiles_nothing(dirs):
    method = "pqo4"
    cfg = dataclasses.asdict(CFG)
    folder = dirs / "ak" / "kernels"
    folder.mkdir(parents=True)
    key = precompile.kernel_key(CFG, method)
    cmd = [
        sys.executable,
        "-m",
        "arraykv.integrations.decoder.precompile",
        json.dumps(cfg),
        str(folder),
        f"{method}={key}",
    ]
    env = dict(os.environ)
    both = [subprocess.Popen(cmd, env=env) for _ in range(2)]
    assert [p.wait(1800) for p in both] == [0, 0]
    assert (folder / f"{key}.ok").exists() and not (folder / f"{key}.lock").exists()
    assert precompile.start(CFG, [method]) is None
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, json.dumps(cfg), method], env=env, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


_SMALL_INTQ = textwrap.dedent(
    """
    import json
    import numpy as np
    from numba.core import event
    from arraykv import ops

    seen = []

    class L(event.Listener):
        def on_start(self, ev):
            disp = ev.data.get("dispatcher")
            py = getattr(disp, "py_func", None)
            if getattr(py, "__module__", "").startswith("arraykv"):
                seen.append([py.__qualname__, bool(disp.targetoptions.get("parallel"))])

        def on_end(self, ev):
            pass

    event.register("numba:compile", L())
    x = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)
    mn, mx = ops.intq_group_minmax(x, 32)
    scale = np.maximum(mx - mn, 1e-6) / 15
    codes = ops.intq_quantize_pack(x, 32, 4, mn, 1 / scale)
    ops.intq_dequantize(codes, 4, 32, 64, scale, mn)
    print(json.dumps(seen))
    """
)


def test_a_small_integer_quantization_call_compiles_no_parallel_kernel(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    out = subprocess.run([sys.executable, "-c", _SMALL_INTQ], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    compiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert compiled, "nothing compiled: the check saw no kernel"
    assert [name for name, parallel in compiled if parallel] == []
