"""A long prompt through the cache inside the ONNX Runtime graph, stored as the NumPy decoder stores it.

The NumPy decoder computes a prompt of several chunks over its exact keys and values and stores
it compressed in one piece at its end (``prompt_store="exact"``,
:mod:`arraykv.integrations.common.prompt_stage`); :class:`OrtGraphDecoder` must do the same, so that the
engine does not change the quality. The 2-layer random decoder of ``test_ort_graph``
(``tiny_models.ONNX_LLAMA``) runs both as the NumPy decoder and as its rewritten graph.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")


import arraykv  # noqa: E402
from arraykv.integrations.common import prompt_stage  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402

from tiny_models import ONNX_LLAMA as CFG, decoder, llama_onnx  # noqa: E402

CHUNK = 16


@pytest.fixture(scope="module")
def model():
    return decoder(CFG, seed=3)


@pytest.fixture(scope="module")
def dec(model):
    return OrtGraphDecoder(llama_onnx(model))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(17).integers(0, CFG.vocab_size, 120)


def _same_arrays(a, b, layers=2):
    for i in range(layers):
        x, y = a.layer_arrays(i), b.layer_arrays(i)
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(np.asarray(x[name]), np.asarray(y[name]), err_msg=f"layer {i} {name}")


@pytest.mark.parametrize("method", ["pqo2", "pqo4"])
@pytest.mark.parametrize("n", [64, 57])  # a prompt that ends at a chunk boundary, and one that does not
def test_a_chunked_prompt_is_computed_and_stored_as_the_numpy_decoder_does(model, dec, ids, method, n):
    own_cache = model.make_cache(method)
    own = model.prefill(ids[:n], own_cache, chunk_size=CHUNK)  # prompt_store="exact", the default
    chunks = model.prefill(ids[:n], model.make_cache(method), chunk_size=CHUNK, prompt_store="chunks")
    gap = np.abs(chunks - own).max()  # what storing chunk by chunk changes
    assert gap > 0.1
    cache = dec.make_cache(method)
    got = dec.prefill(ids[:n], cache, chunk_size=CHUNK)[0]
    assert got.shape == (n, CFG.vocab_size)
    assert np.abs(got - own).max() < 0.01 * gap
    assert [cache.seq_len(i) for i in range(2)] == [n, n]
    # the same codes, but for a few the two engines' rounding puts on the other side of a boundary
    for i in range(2):
        mine, theirs = cache.layer_arrays(i), own_cache.layer_arrays(i)
        for name in ("k_codes", "v_codes"):
            assert np.mean(np.asarray(mine[name]) != np.asarray(theirs[name])) < 0.005
    # decoding continues from it as the NumPy decoder's does
    for t in ids[n : n + 4]:
        a, b = dec.decode(int(t), cache)[0, 0], model.decode(int(t), own_cache)
        assert np.abs(a - b).max() < 0.1 * gap
    last = dec.prefill(ids[:n], dec.make_cache(method), chunk_size=CHUNK, logits="last")
    np.testing.assert_allclose(last, got[None, -1], atol=1e-5)


def test_the_graph_stores_what_the_numpy_staging_stores_from_the_same_keys_and_values(dec, ids, monkeypatch):
    """Record the operator's calls into the stage; the same calls into the NumPy decoder's staging,
    committed, leave a cache equal to the graph's array for array."""
    calls = []
    real = prompt_stage.PromptStage.prefill

    def record(self, layer, k, v, q):
        calls.append((layer, k.copy(), v.copy(), q.copy()))
        return real(self, layer, k, v, q)

    monkeypatch.setattr(prompt_stage.PromptStage, "prefill", record)
    cache = dec.make_cache("pqo2")
    dec.prefill(ids[:50], cache, chunk_size=CHUNK)
    assert [c[0] for c in calls] == [0, 1] * 4  # four chunks (16, 16, 16, 2), two layers each
    ref = dec.make_cache("pqo2")
    stage = prompt_stage.PromptStage(ref, 2, 50)
    for layer, k, v, q in calls:
        real(stage, layer, k, v, q)
    stage.commit()
    _same_arrays(cache, ref)


def test_a_prompt_of_one_chunk_and_prompt_store_chunks_store_as_they_come(dec, ids):
    one = dec.make_cache("pqo4")
    dec.prefill(ids[:40], one)
    two = dec.make_cache("pqo4")
    dec.prefill(ids[:40], two, chunk_size=40)
    _same_arrays(one, two)
    stepwise = dec.make_cache("pqo4")
    for s in range(0, 40, CHUNK):
        dec.prefill(ids[s : min(s + CHUNK, 40)], stepwise)
    chunks = dec.make_cache("pqo4")
    dec.prefill(ids[:40], chunks, chunk_size=CHUNK, prompt_store="chunks")
    _same_arrays(stepwise, chunks)
    for bad, match in (
        ({"prompt_store": "fast"}, "prompt_store must be 'exact' or 'chunks'"),
        ({"logits": "first"}, "logits must be 'all' or 'last'"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
    ):
        c = dec.make_cache("pqo4")
        with pytest.raises(ValueError, match=match):
            dec.prefill(ids[:40], c, **bad)
        assert c.seq_len(0) == 0


@pytest.mark.parametrize("method", ["pqo2", "int4"])
def test_generate_follows_the_numpy_decoder_on_a_chunked_prompt(model, dec, ids, method):
    prompt = [int(t) for t in ids[:100]]
    cache = dec.make_cache(method)
    own_cache = model.make_cache(method)
    got = dec.generate(prompt, 6, cache=cache, prefill_chunk=CHUNK)
    assert got == model.generate(prompt, 6, cache=own_cache, prefill_chunk=CHUNK)
    for i in range(2):
        mine, theirs = cache.layer_arrays(i)["k_codes"], own_cache.layer_arrays(i)["k_codes"]
        assert np.mean(np.asarray(mine) != np.asarray(theirs)) < 0.005


def test_a_saved_cache_continues_with_a_staged_prompt(model, dec, ids, tmp_path):
    """A second prompt after a saved and loaded cache: the stage starts from the stored tokens."""
    cache = dec.make_cache("pqo4")
    dec.prefill(ids[:40], cache, chunk_size=CHUNK)
    cache.save(tmp_path / "c.akv")
    loaded = arraykv.load(tmp_path / "c.akv")
    a = dec.prefill(ids[40:90], cache, chunk_size=CHUNK)
    b = dec.prefill(ids[40:90], loaded, chunk_size=CHUNK)
    np.testing.assert_array_equal(a, b)
    assert cache.seq_len(0) == loaded.seq_len(1) == 90
    own_cache = model.make_cache("pqo4")
    model.prefill(ids[:40], own_cache, chunk_size=CHUNK)
    own = model.prefill(ids[40:90], own_cache, chunk_size=CHUNK)
    assert np.abs(a[0] - own).max() < 1e-2
    x, y = dec.decode(int(ids[90]), cache), dec.decode(int(ids[90]), loaded)
    assert np.abs(x - y).max() < 1e-5


def test_a_failed_prompt_leaves_the_cache_as_it_was(dec, ids):
    """The prompt is stored all or nothing: a refusal at its end takes back every chunk."""
    cache = dec.make_cache("pqo4", max_tokens=60)
    dec.prefill(ids[:20], cache)
    before = [cache.layer_arrays(i) for i in range(2)]
    with pytest.raises(ValueError, match="max_tokens"):
        dec.prefill(ids[20:70], cache, chunk_size=CHUNK)  # 70 > 60: refused when the prompt is stored
    assert [cache.seq_len(i) for i in range(2)] == [20, 20]
    for i in range(2):
        after = cache.layer_arrays(i)
        for name in after:
            np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(before[i][name]))
    assert np.isfinite(dec.prefill(ids[20:60], cache, chunk_size=CHUNK)).all()
