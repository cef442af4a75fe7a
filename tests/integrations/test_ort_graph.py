"""The arraykv cache inside an ONNX Runtime graph, on a 2-layer random decoder built by the project's exporter.

The same model runs as the NumPy decoder (the reference), as its ONNX graph with the past fed
back (plain ORT), rewritten with the ``ArrayKVAttention`` operator (:class:`OrtGraphDecoder`)
and rewritten with ORT's ``GroupQueryAttention``.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")

import arraykv  # noqa: E402
from arraykv.integrations.onnxruntime.gqa_rewrite import OrtPastLoop, calibrate_kv_scales, rewrite_with_gqa  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402
from arraykv.integrations.onnxruntime.graph_rewrite import (  # noqa: E402
    CACHE_OP,
    GraphRewriteError,
    find_attention_sites,
    rewrite_with_cache_op,
)

from tiny_models import ONNX_LLAMA as CFG, decoder, llama_onnx  # noqa: E402

PROMPT, STEPS = 24, 12


@pytest.fixture(scope="module")
def model():
    return decoder(CFG, seed=3)


@pytest.fixture(scope="module")
def graph(model):
    return llama_onnx(model)


@pytest.fixture(scope="module")
def dec(graph):
    return OrtGraphDecoder(graph)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(7).integers(0, CFG.vocab_size, PROMPT + STEPS)


def _run(engine, ids, cache):
    """Logits (PROMPT + STEPS, vocab): the prompt in one prefill, then one decode per token."""
    first = np.asarray(engine.prefill(ids[:PROMPT], cache)).reshape(PROMPT, -1)
    rest = [np.asarray(engine.decode(int(t), cache)).reshape(-1) for t in ids[PROMPT:]]
    return np.concatenate([first, np.stack(rest)])


def test_rewritten_graph_has_no_past_and_one_op_per_layer(graph, dec):
    rewritten, sites = rewrite_with_cache_op(graph, "some-handle")
    names_in = [i.name for i in dec.session.get_inputs()]
    names_out = [o.name for o in dec.session.get_outputs()]
    assert names_in == ["input_ids", "attention_mask", "position_ids"]
    assert names_out == ["logits"]
    ops = [n for n in rewritten.graph.node if n.op_type == CACHE_OP]
    assert [next(a.i for a in n.attribute if a.name == "layer") for n in ops] == [0, 1]
    assert (dec.num_layers, dec.num_kv_heads, dec.head_dim) == (2, 2, 64)
    assert [s.scale for s in sites] == [s.scale for s in dec.sites] == pytest.approx([1 / 8, 1 / 8])
    assert {a.s for n in ops for a in n.attribute if a.name == "handle"} == {b"some-handle"}
    # the score/softmax/concat nodes are gone, the graph is smaller
    assert not any(n.op_type in ("Softmax", "Concat") and "present" in "".join(n.output) for n in rewritten.graph.node)
    assert (
        sum(n.op_type == "Softmax" for n in rewritten.graph.node)
        == 0
        < sum(n.op_type == "Softmax" for n in graph.graph.node)
    )
    assert len(rewritten.graph.node) < len(graph.graph.node)
    onnx.checker.check_model(rewritten)


def test_dense_in_the_graph_matches_the_numpy_decoder_and_the_float_graph(model, graph, dec, ids):
    ref = _run(model, ids, model.make_cache("dense"))
    cache = dec.make_cache("dense")
    got = _run(dec, ids, cache)
    assert cache.seq_len(0) == cache.seq_len(1) == len(ids)
    assert np.abs(got - ref).max() < 2e-4
    plain = OrtPastLoop(graph)
    assert np.abs(got - _run(plain, ids, plain.make_cache())).max() < 2e-4


@pytest.mark.parametrize("method", ["pqo4", "pqo2", "int4"])
def test_compressed_cache_in_the_graph_is_the_numpy_decoders(model, dec, ids, method):
    exact = _run(model, ids, model.make_cache("dense"))
    ref = _run(model, ids, model.make_cache(method))
    cache = dec.make_cache(method)
    got = _run(dec, ids, cache)
    lossy = np.abs(ref - exact).max()
    assert lossy > 1e-3  # the method changes the logits ...
    assert np.abs(got - ref).max() < 0.1 * lossy  # ... and the graph changes them the same way


def test_decode_uses_the_caches_fused_attention(dec, ids, monkeypatch):
    """pqo4 answers decode with Fused: the graph's node must hand that output on."""
    cache = dec.make_cache("pqo4")
    dec.prefill(ids[:PROMPT], cache)
    seen = []
    real = type(cache).decode

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        seen.append(type(out).__name__)
        return out

    monkeypatch.setattr(type(cache), "decode", spy)
    dec.decode(int(ids[PROMPT]), cache)
    assert seen == ["Fused", "Fused"]


@pytest.mark.parametrize("spinning", [None, "0", "1"])
def test_decode_kernels_use_numbas_threads_unless_ort_spins(graph, ids, monkeypatch, spinning):
    """Inside the graph no OpenBLAS product runs between kernels: they go parallel, unless
    ONNX Runtime's own threads spin (options given with allow_spinning left on)."""
    import onnxruntime as ort

    from arraykv.ops.numba import threads

    options = None
    if spinning is not None:
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    d = OrtGraphDecoder(graph, options=options)
    want = "serial" if spinning == "1" else "parallel"
    assert d._slot.kernels == want
    cache = d.make_cache("pqo4")
    d.prefill(ids[:PROMPT], cache)
    seen = []
    real = type(cache).decode

    def spy(self, *a, **k):
        seen.append(getattr(threads._override, "beside_blas", None))
        return real(self, *a, **k)

    monkeypatch.setattr(type(cache), "decode", spy)
    d.decode(int(ids[PROMPT]), cache)
    assert seen == [want, want]
    with pytest.raises(ValueError, match="kernels must be"):
        type(d._slot)("threads")


@pytest.mark.parametrize("method", ["dense", "pqo4"])
def test_batch_of_two_is_two_single_runs(dec, ids, method):
    other = np.random.default_rng(8).integers(0, CFG.vocab_size, len(ids))
    both = np.stack([ids, other])
    cache = dec.make_cache(method)
    first = dec.prefill(both[:, :PROMPT], cache)
    steps = [dec.decode(both[:, PROMPT + j], cache) for j in range(4)]
    for row, seq in enumerate((ids, other)):
        single = dec.make_cache(method)
        f1 = dec.prefill(seq[:PROMPT], single)
        s1 = [dec.decode([int(seq[PROMPT + j])], single) for j in range(4)]
        assert np.abs(first[row] - f1[0]).max() < 1e-4
        assert max(np.abs(a[row] - b[0]).max() for a, b in zip(steps, s1)) < 1e-4


def test_truncate_and_fork_continue_like_a_fresh_run(dec, ids):
    cache = dec.make_cache("pqo4")
    dec.prefill(ids[:PROMPT], cache)
    first = [dec.decode(int(t), cache)[0, 0] for t in ids[PROMPT : PROMPT + 4]]
    twin = cache.fork()
    cache.truncate_all(PROMPT)
    again = [dec.decode(int(t), cache)[0, 0] for t in ids[PROMPT : PROMPT + 4]]
    assert max(np.abs(a - b).max() for a, b in zip(first, again)) < 1e-5
    nxt = int(ids[PROMPT + 4])
    assert np.abs(dec.decode(nxt, twin) - dec.decode(nxt, cache)).max() < 1e-5
    assert twin.seq_len(0) == cache.seq_len(0) == PROMPT + 5


def test_save_and_load_continue_the_conversation(dec, ids, tmp_path):
    cache = dec.make_cache("pqo4")
    dec.prefill(ids[:PROMPT], cache)
    path = tmp_path / "conversation.akv"
    cache.save(path)
    loaded = arraykv.load(path)
    a = [dec.decode(int(t), cache) for t in ids[PROMPT:]]
    b = [dec.decode(int(t), loaded) for t in ids[PROMPT:]]
    assert max(np.abs(x - y).max() for x, y in zip(a, b)) < 1e-5


@pytest.mark.parametrize("method", ["dense", "pqo4"])
def test_generate_follows_the_numpy_decoders_convention(model, dec, ids, method):
    prompt = [int(t) for t in ids[:PROMPT]]
    want = model.generate(prompt, 8, method=method)
    assert dec.generate(prompt, 8, method=method) == want
    streamed = []
    cache = dec.make_cache(method)
    assert dec.generate(prompt, 8, cache=cache, on_token=streamed.append, prefill_chunk=10) == streamed
    assert cache.seq_len(0) == PROMPT + 7  # the last token is produced, not stored
    with pytest.raises(ValueError, match="empty"):
        dec.generate(prompt, 2, cache=cache)


def test_errors_inside_the_graph_reach_the_caller_and_leave_the_cache_as_it_was(dec, ids):
    """The operator cannot raise (it would end the process); the decoder raises its error after the run."""
    cache = dec.make_cache("pqo4", max_tokens=PROMPT + 1)
    dec.prefill(ids[:PROMPT], cache)
    dec.decode(int(ids[PROMPT]), cache)
    with pytest.raises(ValueError, match="max_tokens|hold|tokens"):  # raised by layer 0's cache, inside ORT
        dec.decode(int(ids[PROMPT + 1]), cache)
    assert [cache.seq_len(i) for i in range(2)] == [PROMPT + 1, PROMPT + 1]
    cache.truncate_all(PROMPT)
    assert np.isfinite(dec.decode(int(ids[PROMPT]), cache)).all()  # the decoder still works
    bad = arraykv.make_cache("dense", num_layers=2, num_kv_heads=2, head_dim=32)  # refused before the run
    with pytest.raises(ValueError, match="head_dim=32"):
        dec.prefill(ids[:PROMPT], bad)
    with pytest.raises(ValueError, match="one token"):
        dec.step(ids[None, :3], cache, mode="decode")
    with pytest.raises(ValueError, match="earlier tokens"):
        dec.decode(1, dec.make_cache("dense"))


def test_graphs_it_cannot_rewrite_are_refused(graph):
    no_past = onnx.ModelProto()
    no_past.CopyFrom(graph)
    for node in no_past.graph.node:  # present.0.key from an Add instead of the Concat with the past
        if node.output[0] == "present.0.key":
            node.op_type = "Add"
            del node.attribute[:]
    with pytest.raises(GraphRewriteError, match="layer 0: present.0.key is computed by Add"):
        find_attention_sites(no_past)
    fused = onnx.ModelProto()
    fused.CopyFrom(graph)
    for node in fused.graph.node:  # the value MatMul replaced by a fused op
        if node.op_type == "Softmax":
            node.op_type = "LogSoftmax"
    with pytest.raises(GraphRewriteError, match="LogSoftmax between the score MatMul and the Softmax"):
        rewrite_with_cache_op(fused, "h")
    plain = onnx.ModelProto()
    plain.CopyFrom(graph)
    kept = [i for i in plain.graph.input if not i.name.startswith("past_key_values")]
    del plain.graph.input[:]
    plain.graph.input.extend(kept)
    with pytest.raises(GraphRewriteError, match="no past_key_values"):
        OrtGraphDecoder(plain)


def test_gqa_float_path_matches_and_quantized_paths_hold_fewer_bytes(graph, ids):
    plain = OrtPastLoop(graph)
    st = plain.make_cache()
    ref = _run(plain, ids, st)
    gqa = OrtPastLoop(rewrite_with_gqa(graph, num_heads=4, bits=None))
    assert np.abs(_run(gqa, ids, gqa.make_cache()) - ref).max() < 2e-4
    calib = np.random.default_rng(9).integers(0, CFG.vocab_size, 64)
    errs = {}
    for bits, dtype, width in ((8, np.int8, 64), (4, np.uint8, 32)):
        loop = OrtPastLoop(
            rewrite_with_gqa(graph, num_heads=4, bits=bits, scales=calibrate_kv_scales(graph, calib, bits))
        )
        q = loop.make_cache()
        errs[bits] = np.abs(_run(loop, ids, q) - ref).max()
        assert q.past[0][0].dtype == dtype and q.past[0][0].shape == (1, 2, len(ids), width)
        assert q.memory_usage() * 32 == st.memory_usage() * bits
    assert 0 < errs[8] < errs[4]


@pytest.mark.parametrize("method", ["pqo4", "int4"])
def test_generate_with_a_prefix_store_continues_bit_for_bit(dec, graph, ids, method, tmp_path):
    """A prompt through a prefix store: the cold run stores its prefix, the warm run restores it;
    both hold every array the store's schedule without a store holds (the prompt in segments of
    ``chunk_tokens``, each staged exactly over its prefill chunks), and generate its tokens."""
    from arraykv.store import LocalStore, PrefixStore
    from arraykv.store.prefix import segmented_prefill

    from cache_contract import assert_same_snapshot, snapshot

    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, CFG.vocab_size, 100)]
    plain_cache = dec.make_cache(method)
    want = [int(np.argmax(segmented_prefill(dec, prompt, plain_cache, chunk_tokens=32, chunk_size=16)))]
    while len(want) < 6:
        want.append(int(np.argmax(dec.decode(want[-1], plain_cache))))
    store = PrefixStore(LocalStore(tmp_path / "s"), chunk_tokens=32)
    for reused in (0, 96):  # (100 - 1) // 32 = 3 whole chunks: the longest prefix that leaves a token
        cache = dec.make_cache(method)
        assert dec.generate(prompt, 6, cache=cache, prefill_chunk=16, store=store) == want
        assert store.last_report.reused == reused and store.last_report.stored == ([96] if not reused else [])
        assert_same_snapshot(snapshot(cache), snapshot(plain_cache), restored=reused > 0)
    # the same graph in another form finds the entry (the same model); another model's graph does not
    same = OrtGraphDecoder(graph.SerializeToString() if hasattr(graph, "SerializeToString") else graph)
    assert same.generate(prompt, 6, method=method, prefill_chunk=16, store=store) == want
    assert store.last_report.reused == 96
    other = OrtGraphDecoder(llama_onnx(decoder(CFG, seed=4)))
    other.generate(prompt, 1, method=method, prefill_chunk=16, store=store)
    assert store.last_report.reused == 0
    with pytest.raises(ValueError, match="multiple of prefill_chunk"):
        dec.generate(prompt, 1, method=method, prefill_chunk=24, store=store)


def test_graph_identity_names_structure_and_weights(graph):
    from arraykv.store.keys import onnx_identity

    proto = onnx.load_from_string(graph) if isinstance(graph, bytes) else graph
    base = onnx_identity(proto)
    assert base == onnx_identity(onnx.load_from_string(proto.SerializeToString()))
    changed = onnx.load_from_string(proto.SerializeToString())
    init = max(changed.graph.initializer, key=lambda t: len(t.raw_data) or len(t.float_data))
    arr = onnx.numpy_helper.to_array(init).copy()
    arr.flat[0] += 1.0  # the first value: always in the sample
    init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    assert onnx_identity(changed) != base
    with pytest.raises(TypeError, match="ModelProto"):
        onnx_identity(b"not a model")


def _save(graph, folder, name="model.onnx", **kw):
    """``graph`` saved as ``folder/name`` (a copy: saving with external data changes the proto)."""
    folder.mkdir(exist_ok=True)
    if "/" in kw.get("location", ""):
        (folder / kw["location"]).parent.mkdir(parents=True, exist_ok=True)
    path = folder / name
    copy = onnx.ModelProto()
    copy.CopyFrom(graph)
    onnx.save_model(copy, str(path), **kw)
    return path


@pytest.mark.parametrize(
    "layout",
    [
        {"save_as_external_data": True, "location": "weights/w.bin", "size_threshold": 1024},
        {"save_as_external_data": True, "location": "w.bin", "size_threshold": 0},  # scales on disk too
        {},  # weights inside the file
    ],
    ids=["external", "all-external", "inside"],
)
def test_a_file_opens_on_its_own_weights_and_leaves_nothing_behind(graph, dec, ids, tmp_path, layout, monkeypatch):
    from arraykv.integrations.onnxruntime import graph_files
    from arraykv.integrations.onnxruntime.graph_files import load_graph
    from arraykv.store.keys import onnx_identity

    path = _save(graph, tmp_path, **layout)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    written = []
    real_write = graph_files.write_graph

    def spy(g, folder, stem):
        written.append(folder)
        return real_write(g, folder, stem)

    monkeypatch.setattr(graph_files, "write_graph", spy)
    from_file = OrtGraphDecoder(str(path))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # only a graph that reads the model's data files is written beside them; weights held in
    # the file go to a temporary folder, not next to the model
    assert (written[0] == str(tmp_path)) == bool(layout)
    assert [s.scale for s in from_file.sites] == [s.scale for s in dec.sites]
    got = _run(from_file, ids, from_file.make_cache("pqo4"))
    assert np.array_equal(got, _run(dec, ids, dec.make_cache("pqo4")))
    # the store's name of the graph is the one of the model loaded whole
    assert from_file._identity() == "onnx:" + onnx_identity(onnx.load(str(path)))
    proto, base = load_graph(str(path))
    if layout:  # the weights stayed on disk, the small constants were read
        assert base == str(tmp_path)
        assert max(len(t.raw_data) for t in proto.graph.initializer) <= 64 * 8


def test_a_graph_written_elsewhere_links_the_weights(graph, dec, ids, tmp_path):
    path = _save(graph, tmp_path / "m", save_as_external_data=True)
    work = tmp_path / "work"
    work.mkdir()
    before = sorted(p.name for p in path.parent.iterdir())
    from_file = OrtGraphDecoder(str(path), work_dir=str(work))
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in path.parent.iterdir()) == before
    got = _run(from_file, ids, from_file.make_cache("dense"))
    assert np.array_equal(got, _run(dec, ids, dec.make_cache("dense")))


def test_external_data_outside_the_models_folder_is_refused(graph, tmp_path):
    folder = tmp_path / "m"
    path = _save(graph, folder, save_as_external_data=True, location="w.bin")
    proto = onnx.load(str(path), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../w.bin"
    (folder / "w.bin").rename(tmp_path / "w.bin")
    onnx.save_model(proto, str(path))
    with pytest.raises(ValueError, match="not inside the model's folder"):
        OrtGraphDecoder(str(path))
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx"]


def test_the_operator_loads_without_the_extensions_packages_converters():
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from arraykv.integrations.onnxruntime.cache_operator import session_options\n"
        "session_options()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'onnxruntime_extensions') if m in sys.modules))\n"
        "print(os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))\n"
        "ocos = sys.modules['onnxruntime_extensions._ocos']\n"
        "import onnxruntime_extensions\n"  # the package itself still imports, on the same operator API
        "print(onnxruntime_extensions.get_library_path() == ocos.get_library_path())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "None", "True"]
