"""The wheel ships every module and every CUDA source, and the installed package finds them."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from arraykv.ops import kernel_names, kernel_source

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernel_sources_found_from_this_install():
    on_disk = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert on_disk, "kernels/ holds no .cu file"
    assert kernel_names() == on_disk
    text, path = kernel_source(on_disk[0])
    assert text == (ROOT / "kernels" / on_disk[0]).read_text()
    with pytest.raises(FileNotFoundError, match="not found"):
        kernel_source("no_such_kernel.cu")


@pytest.mark.slow
def test_wheel_contains_modules_and_kernels(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("arraykv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for cu in (ROOT / "kernels").glob("*.cu"):
        assert f"arraykv/kernels/{cu.name}" in names
    for py in (ROOT / "arraykv").rglob("*.py"):
        assert py.relative_to(ROOT).as_posix() in names, f"{py} missing from the wheel (list its package in setup.cfg)"
    # Install the wheel into a private folder and ask that copy for its kernels.
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    code = "import arraykv, arraykv.ops as b; print(arraykv.__file__); print(','.join(b.kernel_names()))"
    env = dict(os.environ, PYTHONPATH=str(target))
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert res.returncode == 0, res.stderr
    file_line, kernels_line = res.stdout.strip().splitlines()
    assert file_line.startswith(str(target))
    assert kernels_line.split(",") == sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
