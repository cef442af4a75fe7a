"""The files an ONNX Runtime session is opened from: every layout plain ONNX Runtime opens, nothing left behind.

:class:`OrtGraphDecoder` and the hook (:class:`OrtKVDecoder`, queries exposed) write a
rewritten graph for the moment ONNX Runtime opens it
(:mod:`arraykv.integrations.onnxruntime.graph_files`). These tests build the layouts users have on disk
(huggingface_hub's cache: ``snapshots/<rev>/`` files as relative links into ``blobs/``; a linked
model file; a linked folder), kill a real process while its file exists, and run out of room.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")

from arraykv.integrations.onnxruntime import OrtKVDecoder, graph_files  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402
from arraykv.integrations.onnxruntime.scratch_files import owned_name, remove_stale  # noqa: E402

from tiny_models import ONNX_LLAMA as CFG, decoder, llama_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IDS = [5, 17, 3, 60, 22, 9, 41, 8]


@pytest.fixture(scope="module")
def graph():
    return llama_onnx(decoder(CFG, seed=3))


@pytest.fixture(scope="module")
def expected(graph):
    """Logits of the tiny graph opened from memory: the prompt, then two decodes."""
    return _logits(OrtGraphDecoder(graph))


def _logits(dec):
    cache = dec.make_cache("dense")
    out = [np.asarray(dec.prefill(IDS[:-2], cache)).reshape(len(IDS) - 2, -1)]
    out += [np.asarray(dec.decode(t, cache)).reshape(1, -1) for t in IDS[-2:]]
    return np.concatenate(out)


def _save(graph, path: Path, **kw) -> Path:
    """``graph`` as ``path`` with its weights in ``path.name + '_data'`` (Optimum's naming)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(graph)  # saving with external data changes the proto
    kw = {"save_as_external_data": True, "location": path.name + "_data", "size_threshold": 1024, **kw}
    onnx.save_model(copy, str(path), **kw)
    return path


def _hub(graph, root: Path, links=("model.onnx", "model.onnx_data")) -> Path:
    """huggingface_hub's cache of one export: ``snapshots/<rev>/<file>`` -> ``../../blobs/<hash>``."""
    src = _save(graph, root / "download" / "model.onnx")
    snap = root / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for name in ("model.onnx", "model.onnx_data"):
        if name in links:
            blob = "9f8e7d" if name == "model.onnx" else "1a2b3c"
            os.rename(src.parent / name, root / "blobs" / blob)
            os.symlink(f"../../blobs/{blob}", snap / name)
        else:
            os.rename(src.parent / name, snap / name)
    src.parent.rmdir()
    return snap / "model.onnx"


def _tree(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The system's temporary folder for this test alone (``tempfile.tempdir``)."""
    import tempfile

    folder = tmp_path / "systmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.parametrize(("engine", "where"), [("graph", "beside"), ("graph", "work_dir"), ("hook", "beside")])
def test_the_hub_cache_layout_opens_as_onnx_runtime_opens_it(graph, expected, tmp_path, private_tmp, engine, where):
    path = _hub(graph, tmp_path / "hub")
    ort.InferenceSession(str(path))  # the layout is one ONNX Runtime opens
    work = tmp_path / "work"
    work.mkdir()
    before = _tree(tmp_path)
    if engine == "graph":
        dec = OrtGraphDecoder(str(path), work_dir=str(work) if where == "work_dir" else None)
        assert np.array_equal(_logits(dec), expected)
    else:
        dec = OrtKVDecoder(str(path), queries=True)
        assert dec.query_outputs  # the graph was rewritten and opened from a file
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("layout", ["linked-model", "linked-folder"])
def test_a_linked_model_file_or_folder_opens(graph, expected, tmp_path, private_tmp, layout):
    if layout == "linked-model":
        path = _hub(graph, tmp_path / "hub", links=("model.onnx",))
    else:
        _save(graph, tmp_path / "real" / "model.onnx")
        os.symlink("real", tmp_path / "linked")
        path = tmp_path / "linked" / "model.onnx"
    ort.InferenceSession(str(path))
    before = _tree(tmp_path)
    assert np.array_equal(_logits(OrtGraphDecoder(str(path))), expected)
    assert _tree(tmp_path) == before


def test_a_data_link_out_of_the_models_folders_is_refused_as_onnx_runtime_refuses_it(graph, tmp_path, private_tmp):
    path = _hub(graph, tmp_path / "hub", links=("model.onnx_data",))  # the model file itself is not a link
    with pytest.raises(Exception, match="escapes model directory"):
        ort.InferenceSession(str(path))
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="not inside the model's folder"):
        OrtGraphDecoder(str(path))
    assert _tree(tmp_path) == before


_CHILD = """
import sys, time
import onnxruntime
real = onnxruntime.InferenceSession
def paused(path, *a, **k):
    print("OPENING", path, flush=True)
    time.sleep(600)
onnxruntime.InferenceSession = paused
import tempfile
tempfile.tempdir = sys.argv[3]
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder
OrtGraphDecoder(sys.argv[1], work_dir=sys.argv[2] or None)
"""


def _paused_child(path: Path, work: Path | None, systmp: Path):
    """A process stopped inside ``InferenceSession``, its graph file written: ``(process, that file)``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(work or ""), str(systmp)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    line = proc.stdout.readline()
    assert line.startswith("OPENING "), line
    return proc, Path(line.split(" ", 1)[1].strip())


@pytest.mark.parametrize("weights", ["external", "inside"])
def test_a_killed_process_leaves_files_that_the_next_open_removes(graph, tmp_path, private_tmp, weights):
    folder = tmp_path / "m"
    if weights == "external":
        path = _save(graph, folder / "model.onnx")
        work = None
    else:
        folder.mkdir()
        path = folder / "model.onnx"
        onnx.save_model(graph, str(path))
        work = tmp_path / "work"
        work.mkdir()
    before = _tree(tmp_path)
    proc, written = _paused_child(path, work, private_tmp)
    try:
        assert written.exists()
        # beside the weights, or with a copy of them in a temporary folder of work_dir
        assert written.parent == folder if work is None else written.parent.parent == work
        OrtGraphDecoder(str(path), work_dir=str(work) if work else None)  # the owner lives: kept
        assert written.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert written.exists()  # nothing removes a killed process's file ...
    OrtGraphDecoder(str(path), work_dir=str(work) if work else None)
    assert _tree(tmp_path) == before  # ... but the next open


def test_stale_names_are_removed_only_where_the_owner_is_dead(tmp_path):
    mine = owned_name(".arraykv-", ".onnx")
    machine, boot, pid, start, rand = mine[len(".arraykv-") : -len(".onnx")].split("-")
    names = {
        "mine": mine,  # this process: alive
        "other-machine": f".arraykv-{'0' * 8 if machine != '0' * 8 else '1' * 8}-{boot}-1-1-{rand}.onnx",
        "earlier-boot": f".arraykv-{machine}-{'f' * 8 if boot != 'f' * 8 else 'e' * 8}-{pid}-{start}-{rand}.onnx",
        "reused-pid": f".arraykv-{machine}-{boot}-{pid}-{int(start) + 1}-{rand}.onnx.data",
        "no-tag": f".arraykv-{rand * 2}00000000.onnx",  # an older name: no owner to tell
        "user's": "model.onnx",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale(str(tmp_path), ".arraykv-", (".onnx", ".onnx.data"))
    assert sorted(Path(p).name for p in removed) == sorted([names["earlier-boot"], names["reused-pid"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("mine", "other-machine", "no-tag", "user's")
    )


@pytest.mark.parametrize("weights", ["external", "inside"])
def test_an_interrupt_while_the_session_opens_leaves_nothing(graph, tmp_path, private_tmp, monkeypatch, weights):
    folder = tmp_path / "m"
    if weights == "external":
        path = _save(graph, folder / "model.onnx")
    else:
        folder.mkdir()
        path = folder / "model.onnx"
        onnx.save_model(graph, str(path))
    before = _tree(tmp_path)
    seen = []

    def interrupted(source, *a, **k):
        seen.append(Path(source))
        assert Path(source).exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(ort, "InferenceSession", interrupted)
    with pytest.raises(KeyboardInterrupt):
        OrtGraphDecoder(str(path))
    assert seen and _tree(tmp_path) == before


def test_no_room_beside_the_weights_falls_back_to_a_temp_folder(graph, expected, tmp_path, private_tmp, monkeypatch):
    path = _save(graph, tmp_path / "m" / "model.onnx")
    before = _tree(tmp_path)
    real_write = graph_files.write_graph
    places = []

    def full_beside(g, folder, stem):  # the model's disk is full: a partial file, then ENOSPC
        places.append(folder)
        if Path(folder) == path.parent:
            (Path(folder) / stem).write_bytes(b"\x08\x07partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(g, folder, stem)

    monkeypatch.setattr(graph_files, "write_graph", full_beside)
    dec = OrtGraphDecoder(str(path))
    assert [Path(p).parent for p in places] == [tmp_path, private_tmp]
    assert _tree(tmp_path) == before
    assert np.array_equal(_logits(dec), expected)


_FULL = """
import os, resource, signal, sys, tempfile
tempfile.tempdir = sys.argv[2]
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    OrtGraphDecoder(sys.argv[1])
except OSError as e:
    print("ERROR", type(e).__name__, e.errno, e)
"""


def test_no_room_anywhere_is_one_clear_error_and_leaves_nothing(graph, tmp_path, private_tmp):
    path = _save(graph, tmp_path / "m" / "model.onnx")
    before = _tree(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _FULL, str(path), str(private_tmp)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=300,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1, out.stdout + out.stderr
    assert f"OSError {errno.EFBIG} " in lines[0]
    assert "beside the weights in" in lines[0] and str(path.parent) in lines[0]
    assert "in a temporary folder in" in lines[0] and str(private_tmp) in lines[0]
    assert "work_dir=" in lines[0]
    assert _tree(tmp_path) == before


@pytest.mark.slow
def test_the_smollm2_export_opens_from_a_hub_cache(tmp_path, private_tmp):
    """SmolLM2-135M exported (653 MB of external data) into huggingface_hub's cache layout."""
    from arraykv import eval as ev

    from smollm import smollm_or_skip

    model = smollm_or_skip()
    ids = ev.builtin_token_ids(model, 24)
    path = _hub(llama_onnx(model), tmp_path / "hub")
    del model
    plain = ort.InferenceSession(str(path))  # the float graph, the past empty
    n = len(ids)
    feeds = {
        "input_ids": np.asarray([ids], np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    for i in plain.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, 3, 0, 64), np.float32)
    want = plain.run(["logits"], feeds)[0].reshape(n, -1)
    del plain
    before = _tree(tmp_path)
    dec = OrtGraphDecoder(str(path))
    assert _tree(tmp_path) == before  # nothing left in snapshots/, blobs/ or the temporary folder
    got = np.asarray(dec.prefill(ids, dec.make_cache("dense"))).reshape(n, -1)
    assert np.abs(got - want).max() < 1e-4
