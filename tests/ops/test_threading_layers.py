"""Thread safety of the CPU kernels under every Numba threading layer.

Numba's ``workqueue`` layer (its fallback where neither OpenMP nor TBB is installed) aborts the
process when two Python threads run ``parallel=True`` kernels at once. The threading policy
(:mod:`arraykv.ops.numba.threads`) serializes parallel launches under that layer; these tests
run two threads decoding different layers of large caches in a subprocess with
``NUMBA_THREADING_LAYER=workqueue`` and check that it exits cleanly with the outputs of a
one-thread run.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba  # noqa: F401 - a dependency of the package
import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import threading
    import numpy as np
    import arraykv

    TOKENS = 20000
    H, G, D = 2, 2, 64

    def filled(method):
        rng = np.random.default_rng(7)
        cache = arraykv.make_cache(method, num_layers=2, num_kv_heads=H, head_dim=D)
        steps = []
        for layer in range(2):
            k = rng.standard_normal((1, H, TOKENS, D)).astype(np.float32)
            v = rng.standard_normal((1, H, TOKENS, D)).astype(np.float32)
            q = rng.standard_normal((1, H * G, TOKENS, D)).astype(np.float32)
            cache.append(layer, k, v, q)
            steps.append([tuple(rng.standard_normal(s).astype(np.float32)
                                for s in ((1, H, 1, D), (1, H, 1, D), (1, H * G, 1, D))) for _ in range(6)])
        return cache, steps

    def decode_layer(cache, layer, steps, out):
        cfg = arraykv.AttendConfig(D ** -0.5, G)
        res = []
        for k, v, q in steps:
            o = cache.decode(layer, k, v, q, cfg)
            res.append(np.asarray(o.output if isinstance(o, arraykv.Fused) else o.result.k))
        out[layer] = res

    for method in ("int8", "vq", "pqo4"):
        serial = {}
        cache, steps = filled(method)
        decode_layer(cache, 0, steps[0], serial)
        decode_layer(cache, 1, steps[1], serial)
        cache, steps = filled(method)
        both = {}
        threads = [threading.Thread(target=decode_layer, args=(cache, layer, steps[layer], both)) for layer in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for layer in (0, 1):
            for a, b in zip(serial[layer], both[layer]):
                np.testing.assert_array_equal(a, b)
        print(method, "ok", flush=True)
    import numba
    print("layer", numba.threading_layer())
""")


@pytest.mark.slow
def test_two_threads_decode_under_workqueue_layer():
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env, cwd=str(ROOT)
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "int8 ok" in out.stdout and "vq ok" in out.stdout and "pqo4 ok" in out.stdout
    assert "layer workqueue" in out.stdout


def test_launches_wait_for_each_other_only_where_needed():
    from arraykv.ops.numba import threads

    with threads.launch(0) as n:
        assert n >= 1  # a launch runs and tells its thread count
    layer = __import__("numba").threading_layer()
    assert threads.launches_serialized() == (layer == "workqueue")


def test_serial_below_is_per_thread_and_restored():
    import threading

    from arraykv.ops.numba import threads

    assert threads.threads_for(threads.PARALLEL_MIN_WORK - 1) == 1
    seen = []
    with threads.serial_below(1 << 62):
        assert threads.threads_for(1 << 40) == 1
        t = threading.Thread(target=lambda: seen.append(threads.threads_for(threads.PARALLEL_MIN_WORK)))
        t.start()
        t.join()
    assert seen == [max(1, __import__("numba").get_num_threads())] or seen[0] >= 1
    assert threads.threads_for(threads.PARALLEL_MIN_WORK) >= 1


def test_kernels_run_serially_beside_a_threaded_blas(monkeypatch):
    """A parallel region launched between threaded OpenBLAS products waits for the cores its
    spinning threads hold; the policy runs kernels serially while OpenBLAS has several threads."""
    import numba as nb

    from arraykv.ops.numba import threads

    if nb.get_num_threads() < 2:
        pytest.skip("one Numba thread")
    monkeypatch.setattr(threads, "blas_threads", lambda: 2)
    with threads.beside_blas("serial"):
        assert threads.threads_for(1 << 40) == 1
    with threads.beside_blas("parallel"):
        assert threads.threads_for(1 << 40) == nb.get_num_threads()
    monkeypatch.setattr(threads, "blas_threads", lambda: 1)
    with threads.beside_blas("serial"):
        assert threads.threads_for(1 << 40) == nb.get_num_threads()
        assert threads.threads_for(1) == 1
    with pytest.raises(ValueError, match="mode must be"):
        with threads.beside_blas("fast"):
            pass


def test_blas_threads_answers_for_numpys_openblas():
    from arraykv.ops.numba.threads import blas_threads

    n = blas_threads()
    assert isinstance(n, int) and n >= 1


def test_torchs_intra_op_threads_count_as_a_threaded_blas(monkeypatch):
    """Inside a transformers model the products run on torch's threads, not NumPy's OpenBLAS:
    once torch is imported its thread count decides as the OpenBLAS's does."""
    torch = pytest.importorskip("torch")
    from arraykv.ops.numba import threads

    monkeypatch.setattr(threads, "_BLAS_GET", [lambda: 1])  # NumPy's OpenBLAS on one thread
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads.blas_threads() == 2
        torch.set_num_threads(1)
        assert threads.blas_threads() == 1
    finally:
        torch.set_num_threads(saved)
