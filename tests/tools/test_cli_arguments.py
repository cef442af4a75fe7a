"""Every command-line argument is checked before a model loads: one line on stderr, exit status 2.

Two kinds of proof that nothing loaded first, neither patching anything:

- arguments that need no model are given with a model path that does not exist: the argument's
  error comes, not the missing file's;
- arguments checked against the model (layer count, context length, the model's tokens of a
  text) are given a tiny GGUF whose header is whole but whose weights are cut off: the loader
  refuses that file (checked here), so a refusal naming the argument came before the weights.
"""

from __future__ import annotations

import time

import pytest

from arraykv.__main__ import main

from tiny_models import text_llama_gguf

NO_MODEL = "/nonexistent/arraykv-no-model.gguf"


def _refused(argv, capsys) -> str:
    """The one line ``main(argv)`` printed on refusing it with status 2."""
    t0 = time.perf_counter()
    assert main(argv) == 2
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"arraykv {argv[0]}: error: "), err
    assert elapsed < 5.0  # a model load takes longer; the tiny header reads in milliseconds
    return err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["demo", "--generate-with", "bogus"], "--generate-with: unknown methods ['bogus']"),
        (["demo", "--methods", "pqo4", "bogus"], "--methods: unknown methods ['bogus']"),
        (["demo", "--methods", "pqo4", "int8", "pqo4"], "--methods: pqo4 given more than once"),
        (["demo", "--prefill", "300", "--tokens", "256"], "--tokens must be at least --prefill + 2 = 302"),
        (["demo", "--prefill", "255", "--tokens", "256"], "--tokens must be at least --prefill + 2 = 257"),
        (["speculative", "--method", "bogus"], "--method: unknown methods ['bogus']"),
        (["speculative", "--draft", "cache:bogus"], "--draft: unknown methods ['bogus']"),
        (["speculative", "--draft", "layers:x"], "--draft: bad draft 'layers:x'"),
        (["longctx", "--methods", "dense", "bogus"], "--methods: unknown methods ['bogus']"),
        (["longctx", "--lengths", "300", "300"], "--lengths: 300 given more than once"),
        (["longctx", "--depths", "0.5", "0.5"], "--depths: 0.5 given more than once"),
        (["longctx", "--prefix-lengths", "64", "64"], "--prefix-lengths: 64 given more than once"),
        (["longctx", "--plot", "/nonexistent/dir/x.png"], "--plot: the folder '/nonexistent/dir' does not exist"),
        (["longctx", "--haystack", "   "], "--haystack: the filler text is empty"),
        (["longctx", "--text", "/nonexistent/t.txt"], "--text: text must be 'book', 'pydoc' or a readable"),
        (["longctx", "--no-needle", "--lengths", "300"], "--lengths does not apply with --no-needle"),
        (["longctx", "--no-needle", "--depths", "0.5", "--seed", "3"], "--depths, --seed do not apply"),
        (["longctx", "--no-needle", "--haystack", "book"], "--haystack does not apply with --no-needle"),
        (["longctx", "--no-kl", "--prefix-lengths", "64"], "--prefix-lengths does not apply with --no-kl"),
        (["longctx", "--no-kl", "--text", "pydoc", "--positions", "4"], "--text, --positions do not apply"),
        (["inspect", "--no-plots", "--out", "somewhere"], "--out does not apply with --no-plots"),
    ],
)
def test_arguments_that_need_no_model_are_refused_before_the_model_is_looked_for(argv, said, capsys):
    err = _refused([*argv, "--model", NO_MODEL], capsys)
    assert said in err and "does not exist; pass the path" not in err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["inspect", "--synthetic", "--layer", "999"], "--layer does not apply with --synthetic"),
        (["inspect", "--synthetic", "--model", NO_MODEL], "--model does not apply with --synthetic"),
        (["inspect", "--synthetic", "--no-plots", "--out", "x"], "--out does not apply with --no-plots"),
    ],
)
def test_inspect_refuses_what_synthetic_or_no_plots_would_ignore(argv, said, capsys):
    assert said in _refused(argv, capsys)


def test_output_paths_are_checked_before_anything_runs(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    err = _refused(["inspect", "--synthetic", "--out", str(tmp_path / "a-file" / "plots")], capsys)
    assert "--out:" in err and "is a file, not a folder" in err
    err = _refused(["longctx", "--model", NO_MODEL, "--plot", str(tmp_path)], capsys)
    assert "--plot:" in err and "is a folder" in err
    pytest.importorskip("matplotlib")
    err = _refused(["longctx", "--model", NO_MODEL, "--plot", str(tmp_path / "grid.bogus")], capsys)
    assert "--plot: matplotlib cannot write .bogus files" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    """A 2-layer tiny GGUF (context 512) whose weights are cut off: its header reads, it does not load."""
    path = text_llama_gguf(tmp_path_factory.mktemp("headless") / "tiny.gguf")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return str(path)


def test_the_headless_model_does_not_load(headless, capsys):
    """The control: valid arguments reach the loader, which refuses the cut-off weights."""
    assert main(["inspect", "--model", headless, "--layer", "1", "--no-plots"]) == 2
    assert "is not a readable GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["inspect", "--layer", "999"], "--layer: must be below the model's 2 layers, received 999"),
        (["inspect", "--layer", "2"], "--layer: must be below the model's 2 layers, received 2"),
        (["demo", "--tokens", "600"], "--tokens: 600 exceeds the model's context length of 512"),
        (["demo", "--max-new-tokens", "600"], "--max-new-tokens: the prompt ("),
        (["demo", "--prompt", ""], "--prompt: the text is empty"),
        (["longctx", "--lengths", "1"], "--lengths: length must be an integer >= 2, received 1"),
        (["longctx", "--lengths", "30"], "--lengths: length 30 leaves no room for filler"),
        (["longctx", "--lengths", "600"], "--lengths: [600] exceed the model's context length of 512"),
        (["longctx", "--no-needle", "--prefix-lengths", "400", "--positions", "200"], "--prefix-lengths: [400] plus"),
        (["speculative", "--draft", "layers:2"], "--draft: layers must be below the model's 2 layers, received 2"),
        (["speculative", "-k", "20"], "--method: the pqo4 cache keeps rollback copies of 16 tokens"),
        (["speculative", "-k", "9", "--concurrent"], "this k may take back 17"),
        (["speculative", "--draft", "cache:int8", "--method", "dense", "-k", "20"], "--draft: the int8 cache keeps"),
        (["speculative", "--max-new-tokens", "500"], "--max-new-tokens: the prompt ("),
    ],
)
def test_arguments_checked_against_the_model_are_refused_before_its_weights_load(headless, argv, said, capsys):
    err = _refused([*argv, "--model", headless], capsys)
    assert said in err and "not a readable GGUF file" not in err


def test_a_long_text_shorter_than_the_prefixes_is_refused_before_the_weights(headless, tmp_path, capsys):
    story = tmp_path / "story.txt"
    story.write_text("The sky is blue.\n" * 10, encoding="utf-8")
    argv = ["longctx", "--model", headless, "--no-needle", "--text", str(story), "--prefix-lengths", "300"]
    err = _refused([*argv, "--positions", "8"], capsys)
    assert f"--text: the file {story} has " in err and "needs 309" in err


def test_the_header_reader_reads_what_the_gguf_package_reads(tmp_path):
    gguf = pytest.importorskip("gguf")
    from arraykv.cli_model import model_header, read_metadata
    from arraykv.eval.texts import builtin_text
    from arraykv.integrations.decoder.tokenizer import tokenizer_from_gguf

    path = text_llama_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == fields
    header = model_header(str(path))
    assert (header.num_layers, header.context_length, header.num_kv_heads, header.head_dim) == (2, 512, 2, 8)
    text = builtin_text()[:2000]
    assert header.tokenizer.encode(text) == tokenizer_from_gguf(reader).encode(text)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_metadata(tmp_path / "not.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300])  # inside the metadata
    with pytest.raises(ValueError, match="past the end of the file"):
        read_metadata(cut)
