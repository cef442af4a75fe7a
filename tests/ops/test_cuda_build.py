"""CUDA sources compile, launch plans are checked, and GPU kernels match the CPU reference."""

import importlib
import pathlib
import pkgutil
import shutil
import subprocess

import numpy as np
import pytest

import arraykv.ops.cuda
from arraykv.ops.cuda.bitpack import plan_bitpack
from arraykv.ops.cuda.loader import DEFAULT_OPTIONS

from gpu import requires_gpu
from nvrtc import compile_source, find_nvrtc

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "kernels").glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_for_hopper(source, tmp_path):
    res = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "--ptx", "-o", str(tmp_path / "out.ptx"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr


def _launcher_names() -> dict:
    """``{source file: name expressions}`` that the launcher modules export (``SOURCE``, ``name_expressions``)."""
    found: dict = {}
    for info in pkgutil.iter_modules(arraykv.ops.cuda.__path__):
        mod = importlib.import_module(f"arraykv.ops.cuda.{info.name}")
        if hasattr(mod, "SOURCE"):
            found.setdefault(mod.SOURCE, set()).update(mod.name_expressions())
    return {src: sorted(names) for src, names in found.items()}


LAUNCHER_NAMES = _launcher_names()


def test_every_cuda_source_has_a_launcher_that_names_its_kernels():
    assert sorted(LAUNCHER_NAMES) == sorted(p.name for p in SOURCES)
    assert all(LAUNCHER_NAMES.values())


@pytest.mark.skipif(find_nvrtc() is None, reason="no NVRTC library found (set ARRAYKV_NVRTC)")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_with_nvrtc(source):
    # NVRTC is what cupy.RawModule runs: no CUDA include folder, templates by name expression
    names = LAUNCHER_NAMES[source.name]
    ok, log, lowered = compile_source(
        find_nvrtc(),
        f'#line 1 "{source}"\n' + source.read_text(),
        source.name,
        names,
        list(DEFAULT_OPTIONS) + ["-arch=compute_90"],
    )
    assert ok, log
    assert set(lowered) == set(names)


def test_bitpack_plan():
    p = plan_bitpack(rows=10, n=13, bits=3, threads=8)
    assert p.row_bytes == 5 and p.grid == (3,) and p.block == (8,)  # 10 rows * 2 groups = 20 threads
    assert plan_bitpack(0, 0, 4).grid == (1,)
    with pytest.raises(ValueError, match="bits"):
        plan_bitpack(1, 8, 0)
    with pytest.raises(ValueError, match="rows"):
        plan_bitpack(-1, 8, 2)


def test_loader_asks_for_cupy_when_missing():
    from arraykv.ops.cuda import loader as _cuda

    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"arraykv\[cuda\]"):
            _cuda.load_module("bitpack.cu", ["pack_bits<4>"])
    else:
        pytest.skip("CuPy is installed")


@requires_gpu
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(1,), (13,), (4, 3, 64), (2, 129)])
def test_gpu_bitpack_matches_cpu(bits, shape):
    import cupy as cp

    from arraykv.ops.cuda.bitpack import pack_bits_into as pack_bits, unpack_bits_into as unpack_bits
    from arraykv.quant.bitpack import pack_bits_reference

    rng = np.random.default_rng(bits * 100 + len(shape))
    codes = rng.integers(0, 2**bits, size=shape, dtype=np.uint8)
    want = pack_bits_reference(codes, bits)
    # outputs start poisoned (0xAB) so an element the kernel never writes is caught
    packed = cp.full(want.shape, 0xAB, dtype=cp.uint8)
    pack_bits(cp.asarray(codes), bits, out=packed)
    np.testing.assert_array_equal(packed.get(), want)
    back = cp.full(codes.shape, 0xAB, dtype=cp.uint8)
    unpack_bits(packed, bits, shape[-1], out=back)
    np.testing.assert_array_equal(back.get(), codes)
