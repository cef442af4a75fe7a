"""A refused decoder step: the ONNX loop leaves every layer as it was; DecoderModel refuses a torn cache.

The ONNX loop gets every layer's new K/V at once and checks them all before storing any. In
DecoderModel the layers run in sequence (layer 1's K/V need layer 0's attention over its stored
token), so a step refused by a later layer has stored its tokens in the earlier ones; the model
then refuses that cache, naming the layer lengths, instead of growing the layers apart.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import arraykv

from tiny_models import STEP_LLAMA as CFG, decoder

_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not _ONNX, reason="onnx and onnxruntime (extra [onnx]) are not installed")


def _ort_decoder():
    from test_onnx_hook import _decoder_graph

    from arraykv.integrations.onnxruntime import OrtKVDecoder

    return OrtKVDecoder(_decoder_graph())


class _Spoiling:
    """A session that runs the real one, then spoils one ``present`` output when armed."""

    def __init__(self, session):
        self.session = session
        self.spoil = None  # (output name, how)

    def run(self, names, feeds):
        res = self.session.run(names, feeds)
        if self.spoil is not None:
            name, how = self.spoil
            i = names.index(name)
            a = np.array(res[i])
            if how == "nan":
                a[0, 0, -1, 3] = np.nan
            elif how == "short":
                a = a[:, :, :-1]
            elif how == "heads":
                a = a[:, :1]
            res[i] = a
        return res


def _snapshot(cache, layers):
    return [
        (cache.seq_len(i), {n: np.array(a) for n, a in cache._layer_arrays(cache._states[i]).items()})
        for i in range(layers)
    ]


@needs_onnx
@pytest.mark.parametrize("method", ["dense", "int4", "pqo4"])
@pytest.mark.parametrize(
    "spoil",
    [("present.1.key", "nan"), ("present.1.value", "nan"), ("present.1.value", "short"), ("present.1.key", "heads")],
)
def test_a_refused_step_stores_no_layer(method, spoil):
    dec = _ort_decoder()
    fake = _Spoiling(dec.session)
    dec.session = fake
    cache = dec.make_cache(method)
    dec.prefill([[1, 2, 3, 4, 5]], cache)
    dec.decode([6], cache)
    before = _snapshot(cache, dec.num_layers)
    fake.spoil = spoil
    with pytest.raises(ValueError, match="present.1"):
        dec.decode([7], cache)
    after = _snapshot(cache, dec.num_layers)
    assert [n for n, _ in after] == [n for n, _ in before] == [6, 6]
    for (_, a), (_, b) in zip(after, before):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    # the loop goes on as if the refused step never ran, and matches a loop that never saw it
    fake.spoil = None
    got = dec.decode([7], cache)
    ref_dec = _ort_decoder()
    ref = ref_dec.make_cache(method)
    ref_dec.prefill([[1, 2, 3, 4, 5]], ref)
    ref_dec.decode([6], ref)
    np.testing.assert_array_equal(got, ref_dec.decode([7], ref))
    assert [cache.seq_len(i) for i in range(dec.num_layers)] == [7, 7]


@needs_onnx
def test_a_prefill_refused_at_a_later_layer_leaves_the_cache_empty():
    dec = _ort_decoder()
    fake = _Spoiling(dec.session)
    dec.session = fake
    cache = dec.make_cache("int8")
    fake.spoil = ("present.1.key", "nan")
    with pytest.raises(ValueError, match="non-finite"):
        dec.prefill([[1, 2, 3]], cache)
    assert [cache.seq_len(i) for i in range(dec.num_layers)] == [0, 0]
    fake.spoil = None
    dec.prefill([[1, 2, 3]], cache)  # not refused: nothing was stored
    assert [cache.seq_len(i) for i in range(dec.num_layers)] == [3, 3]


@needs_onnx
def test_layers_of_different_lengths_are_refused_not_grown_apart():
    dec = _ort_decoder()
    cache = dec.make_cache("dense")
    dec.prefill([[1, 2, 3]], cache)
    k = np.zeros((1, dec.num_kv_heads, 1, dec.head_dim), np.float32)
    cache.prefill(0, k, k, k)  # layer 0 alone gets a token
    with pytest.raises(ValueError, match=r"different numbers of tokens \(\[4, 3\]\)"):
        dec.decode([4], cache)
    assert [cache.seq_len(i) for i in range(dec.num_layers)] == [4, 3]


def _arrays(cache, layers):
    return [{n: np.array(a) for n, a in cache.layer_arrays(i).items()} for i in range(layers)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for la, lb in zip(a, b):
        assert la.keys() == lb.keys()
        for n in la:
            np.testing.assert_array_equal(la[n], lb[n], err_msg=n)


@pytest.mark.parametrize("method", ["dense", "int4", "pqo4", "tq3", "lowrank"])
def test_llama_step_refused_by_a_later_layer_leaves_every_layer_as_it_was(method):
    model = decoder(CFG, seed=2)
    cache, ref = model.make_cache(method), model.make_cache(method)
    prompt = list(range(1, 31))
    model.prefill(prompt, cache)
    model.prefill(prompt, ref)
    before = _arrays(cache, 3)
    wk = model.layers[1].wqkv
    saved = np.array(wk)
    wk[...] = np.nan  # layer 1 now computes non-finite K/V: the cache refuses its store
    try:
        with pytest.raises(ValueError, match="non-finite"):
            model.decode(4, cache)  # layer 0 stored the token before layer 1 refused: taken back
        assert [cache.seq_len(i) for i in range(3)] == [30, 30, 30]
        _assert_same(_arrays(cache, 3), before)
        with pytest.raises(ValueError, match="non-finite"):
            model.prefill([5, 6, 7, 8, 9], cache, chunk_size=2)  # three chunks, each refused at layer 1
        _assert_same(_arrays(cache, 3), before)
    finally:
        wk[...] = saved
    # equal caches; the fused kernels' answers over them agree to their last bits (their loop
    # versions depend on where buffers sit in memory)
    for a, b in (
        (model.decode(4, cache), model.decode(4, ref)),
        (model.prefill([5, 6], cache), model.prefill([5, 6], ref)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("method", ["dense", "pqo4", "int8"])
def test_llama_chunked_prefill_refused_in_a_later_chunk_is_taken_back_whole(method):
    model = decoder(CFG, seed=2)
    cache = model.make_cache(method, max_tokens=30)
    model.prefill(list(range(1, 21)), cache)
    before = _arrays(cache, 3)
    with pytest.raises(ValueError, match="max_tokens"):  # chunks of 4: two stored, the third refused
        model.prefill(list(range(21, 41)), cache, chunk_size=4)
    assert [cache.seq_len(i) for i in range(3)] == [20, 20, 20]
    _assert_same(_arrays(cache, 3), before)


@pytest.mark.parametrize("method", ["dense", "int4"])
def test_llama_refuses_a_cache_torn_by_hand(method):
    """A cache whose layers disagree (a step by hand that stopped part way) is refused, not grown apart."""
    model = decoder(CFG, seed=2)
    cache = model.make_cache(method)
    model.prefill([1, 2, 3], cache)
    k = np.ones((1, CFG.num_kv_heads, 1, CFG.head_dim), np.float32)
    cache.prefill(0, k, k, np.ones((1, CFG.num_heads, 1, CFG.head_dim), np.float32))
    for call in (
        lambda: model.decode(5, cache),
        lambda: model.prefill([5, 6], cache),
        lambda: model.forward([5], cache),
    ):
        with pytest.raises(ValueError, match=r"different numbers of tokens \(\[4, 3, 3\]\).*reset"):
            call()
    assert [cache.seq_len(i) for i in range(3)] == [4, 3, 3]  # refused calls store nothing
    with pytest.raises(ValueError, match="different numbers of tokens"):
        model.generate([1, 2], 2, cache=cache)


def test_llama_refuses_a_cache_with_fewer_layers_before_storing():
    model = decoder(CFG, seed=2)
    small = arraykv.make_cache("dense", num_layers=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="layer"):
        model.prefill([1, 2, 3], small)
    assert [small.seq_len(i) for i in range(2)] == [0, 0]
