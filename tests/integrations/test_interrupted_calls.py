"""Calls of the NumPy decoder that continue a non-empty cache and fail at any cache call leave every
layer exactly as it was, and running the call again gives what an uninterrupted run gives, bit for bit.

Each case runs the call once through a :class:`~interrupts.FailingCache` that only counts, then once
per store call ``k`` failing there (``MemoryError`` or ``KeyboardInterrupt``; before the cache, inside
it after its tokens are stored, or after it returned): a continuing prefill of 40 tokens in chunks
of 16 (staged exactly and chunk by chunk), a decode step, and a generation (which starts from an
empty cache, and leaves it empty when it fails). Every method, the hybrid cache of a Gemma-3-like
model included; ``rollback_tokens=0`` too. The slow tests do the same on SmolLM2 and Gemma-3-270M
at a few failure points.
"""

from __future__ import annotations

import numpy as np
import pytest
from interrupts import MODES, FailingCache, assert_same_state, cache_state

import arraykv
from arraykv.integrations.decoder.model import DecoderModel
from arraykv.integrations.decoder.model_config import ModelConfig

from tiny_models import INTERRUPT_GEMMA as GEMMA, INTERRUPT_LLAMA as LLAMA, INTERRUPT_ONNX_LLAMA, decoder, llama_onnx

PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 60, 30)]
MORE = [int(t) for t in np.random.default_rng(2).integers(0, 60, 40)]

_MODELS: dict = {}


def _model(cfg: ModelConfig) -> DecoderModel:
    if cfg.name not in _MODELS:
        _MODELS[cfg.name] = decoder(cfg, seed=2)
    return _MODELS[cfg.name]


def _name(x) -> str:
    return x.arch if isinstance(x, ModelConfig) else str(x)


CASES = [(LLAMA, m) for m in arraykv.available_methods()] + [(GEMMA, m) for m in ("pqo4", "int4", "dense")]


def _ops(model: DecoderModel) -> dict:
    return {
        "prefill-exact": lambda c: model.prefill(MORE, c, chunk_size=16),
        "prefill-chunks": lambda c: model.prefill(MORE, c, chunk_size=16, prompt_store="chunks"),
        "decode": lambda c: model.decode(7, c),
    }


def _run_interrupted(model, make, op, start, check_rerun=True):
    """Every failure point of ``op`` on a cache that ``start`` filled: 0 torn, re-runs exact."""
    ref = make()
    start(ref)
    before = cache_state(ref, model.config.num_layers)
    want = np.array(op(ref))  # the cache itself, as the re-runs get it (an engine may key state by it)
    after = cache_state(ref, model.config.num_layers)
    counter = FailingCache(make())
    start(counter)
    counter.calls = 0  # the op's calls only
    op(counter)
    assert counter.calls > 0
    for k in range(counter.calls):
        for j, mode in enumerate(MODES):
            exc = (MemoryError, KeyboardInterrupt)[(k + j) % 2]
            cache = make()
            start(cache)
            failing = FailingCache(cache, at=k, exc=exc, mode=mode)
            with pytest.raises(exc, match="injected"):
                op(failing)
            failing.restore_cache()
            what = f"call {k} of {counter.calls}, {mode}, {exc.__name__}"
            assert_same_state(cache_state(cache, model.config.num_layers), before, what)
            if check_rerun:
                got = np.array(op(cache))
                np.testing.assert_array_equal(got, want, err_msg=f"re-run after {what}")
                assert_same_state(cache_state(cache, model.config.num_layers), after, f"re-run after {what}")


@pytest.mark.parametrize(("cfg", "method"), CASES, ids=[f"{c.arch}-{m}" for c, m in CASES])
def test_a_continuing_call_failing_at_any_cache_call_leaves_the_cache_as_it_was(cfg, method):
    model = _model(cfg)
    ops = _ops(model)
    names = ["prefill-exact", "decode"] if method not in ("dense", "pqo4", "int4") else list(ops)
    for name in names:
        _run_interrupted(model, lambda: model.make_cache(method), ops[name], lambda c: model.prefill(PROMPT, c))


@pytest.mark.parametrize(("cfg", "method"), [(LLAMA, "pqo4"), (LLAMA, "int4"), (GEMMA, "pqo4")], ids=_name)
def test_longer_than_the_rollback_margin_and_without_one(cfg, method):
    """A 40-token chunk in one call (more than the 16 rollback tokens) and rollback_tokens=0."""
    model = _model(cfg)
    one_call = lambda c: model.prefill(MORE, c)  # noqa: E731
    for options in ({}, {"rollback_tokens": 0}):
        make = lambda o=options: model.make_cache(method, **o)  # noqa: E731
        _run_interrupted(model, make, one_call, lambda c: model.prefill(PROMPT, c))
        _run_interrupted(model, make, lambda c: model.decode(3, c), lambda c: model.prefill(PROMPT, c))


@pytest.mark.parametrize(("cfg", "method"), [(LLAMA, "pqo4"), (LLAMA, "int8"), (GEMMA, "pqo4")], ids=_name)
def test_a_failed_generation_leaves_the_cache_empty_and_a_rerun_is_exact(cfg, method):
    model = _model(cfg)
    gen = lambda c: model.generate(PROMPT[:20], 3, cache=c, prefill_chunk=8)  # noqa: E731
    _run_interrupted(model, lambda: model.make_cache(method), gen, lambda c: None)


def test_a_cache_without_transactions_gets_a_note_when_it_cannot_be_taken_back():
    """The fallback for a cache of the protocol only: truncate_all, and a note when that fails."""
    from arraykv.integrations.common.generation import undo_on_failure

    class Plain:  # the protocol's methods, no transaction(), truncation whose truncate_all refuses
        def seq_len(self, layer):
            return 0

        def prefill(self, *args):
            pass

        def truncate(self, layer, length):
            raise ValueError("cannot reach 5 exactly")

        def can_truncate(self, layer, length):
            return False

        def min_truncate_length(self, layer):
            return 6

        def truncate_all(self, length):
            raise ValueError("cannot reach 5 exactly")

    with pytest.raises(KeyboardInterrupt) as info:
        with undo_on_failure(Plain(), 5):
            raise KeyboardInterrupt
    assert "truncate_all(5) failed: cannot reach 5 exactly" in "".join(info.value.__notes__)


def _real_model_points(model, method: str, prompt_len: int, points: list) -> None:
    """A continuing 40-token prefill (chunks of 16) and a decode step of a real model, failing at
    the given ``(where, mode, exception)`` points: 0 torn, re-runs equal bit for bit."""
    rng = np.random.default_rng(4)
    vocab = model.config.vocab_size
    prompt = [int(t) for t in rng.integers(10, min(vocab, 30000), prompt_len)]
    more = [int(t) for t in rng.integers(10, min(vocab, 30000), 40)]
    n = model.config.num_layers
    ops = {
        "prefill": lambda c: model.prefill(more, c, chunk_size=16, logits="last"),
        "decode": lambda c: model.decode(more[0], c),
    }
    for name, op in ops.items():
        ref = model.make_cache(method)
        model.prefill(prompt, ref, chunk_size=256, logits="last")
        before = cache_state(ref, n)
        counter = FailingCache(ref)
        want = np.array(op(counter))
        after = cache_state(ref, n)
        for at, mode, exc in points:  # ``at``: where among the store calls, 0 first, 1 last
            k = round(at * (counter.calls - 1))
            cache = model.make_cache(method)
            model.prefill(prompt, cache, chunk_size=256, logits="last")
            failing = FailingCache(cache, at=k, exc=exc, mode=mode)
            with pytest.raises(exc, match="injected"):
                op(failing)
            failing.restore_cache()
            what = f"{method} {name}: call {k}, {mode}, {exc.__name__}"
            assert_same_state(cache_state(cache, n), before, what)
            np.testing.assert_array_equal(np.array(op(cache)), want, err_msg=f"re-run after {what}")
            assert_same_state(cache_state(cache, n), after, f"re-run after {what}")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pqo4", "int4"])
def test_smollm2_interrupted_continuing_calls_leave_the_cache_as_it_was(method):
    from smollm import smollm_or_skip

    model = smollm_or_skip()
    points = [(0.05, "after", MemoryError), (0.5, "inside", KeyboardInterrupt), (1.0, "before", KeyboardInterrupt)]
    _real_model_points(model, method, 200, points)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pqo4", "dense"])
def test_gemma3_interrupted_continuing_calls_leave_the_hybrid_cache_as_it_was(method):
    """Gemma-3-270M's hybrid cache past its 512-token window (every sliding layer full)."""
    from gemma import gemma_or_skip

    model = gemma_or_skip(tokenizer=False)
    points = [(0.1, "after", MemoryError), (0.5, "inside", KeyboardInterrupt), (1.0, "after", KeyboardInterrupt)]
    _real_model_points(model, method, 560, points)


@pytest.mark.parametrize("method", ["pqo4", "int4"])
def test_a_stored_prefix_prefill_failing_in_a_later_segment_leaves_the_cache_empty(method, tmp_path):
    """PrefixStore.prefill runs a prompt in segments, each a continuing call: a failure in any
    of them leaves the cache empty, as it was given; run again, the logits are those of a run
    without the failure."""
    from arraykv.store.prefix import PrefixStore

    model = _model(LLAMA)
    store = PrefixStore(str(tmp_path / "store"), chunk_tokens=16, policy="none")
    ids = PROMPT + MORE[:20]  # 50 tokens: segments of 16, 16, 16 and 2
    ref = model.make_cache(method)
    counter = FailingCache(ref)
    want = np.array(store.prefill(model, ids, counter, chunk_size=8))
    for k in range(counter.calls // 3, counter.calls, 3):
        cache = model.make_cache(method)
        failing = FailingCache(cache, at=k, exc=(MemoryError, KeyboardInterrupt)[k % 2], mode="after")
        with pytest.raises((MemoryError, KeyboardInterrupt), match="injected"):
            store.prefill(model, ids, failing, chunk_size=8)
        assert [cache.seq_len(i) for i in range(LLAMA.num_layers)] == [0] * LLAMA.num_layers
        np.testing.assert_array_equal(np.array(store.prefill(model, ids, cache, chunk_size=8)), want)


@pytest.mark.parametrize(("method", "new", "fused"), [("pqo4", 40, False), ("int4", 40, False), ("pqo4", 1, True)])
def test_a_transformers_forward_failing_at_any_layer_is_taken_back_whole(method, new, fused):
    """ArraykvCache given its model: a forward that fails after some layers stored its tokens is
    rolled back at the next call, at any length (40 tokens: beyond the 16 a truncation reaches);
    the cache is as before it, and the forward run again gives the uninterrupted logits. (A
    forward that fails after its last layer stored its tokens is whole: it is committed.)"""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from arraykv.integrations.transformers import ArraykvCache

    from tiny_models import HF_VOCAB, hf_llama

    model = hf_llama(0)
    n = model.config.num_hidden_layers
    ids = torch.randint(0, HF_VOCAB, (1, 30 + new), generator=torch.Generator().manual_seed(3))
    store = "decode" if fused else "prefill"

    def filled():
        cache = ArraykvCache(method, config=model.config, model=model, fused=fused)
        with torch.no_grad():
            model(ids[:, :30], cache=cache)
        return cache

    ref = filled()
    before = cache_state(ref.arraykv_cache, n)
    with torch.no_grad():
        want = model(ids[:, 30:], cache=ref).logits
    ref.detach()
    for k in range(n):
        exc = (MemoryError, KeyboardInterrupt)[k % 2]
        cache = filled()
        inner = cache.arraykv_cache
        real = getattr(inner, store)

        def failing(layer, *args, _k=k, _real=real, _exc=exc):
            if layer == _k == n - 1:  # the last layer: before it stores (after it, the forward is whole)
                raise _exc("injected before the last layer stored its tokens")
            out = _real(layer, *args)
            if layer == _k:
                raise _exc("injected after the layer stored its tokens")
            return out

        setattr(inner, store, failing)
        with pytest.raises(exc, match="injected"), torch.no_grad():
            model(ids[:, 30:], cache=cache)
        delattr(inner, store)
        assert cache.get_seq_length() == 30  # settled: the failed forward rolled back
        assert_same_state(cache_state(inner, n), before, f"layer {k}, {exc.__name__}")
        with torch.no_grad():
            got = model(ids[:, 30:], cache=cache).logits
        cache.detach()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["pqo4", "int4"])
def test_an_onnx_graph_step_failing_at_any_layer_leaves_the_cache_as_it_was(method):
    """OrtGraphDecoder: the graph's cache nodes store layer by layer inside ONNX Runtime; a step
    that fails at any of them (the operator reports it after the run) is rolled back whole."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxruntime_extensions")
    from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder

    model = decoder(INTERRUPT_ONNX_LLAMA, seed=3)
    dec = OrtGraphDecoder(llama_onnx(model))
    for op in (lambda c: dec.prefill(np.asarray([MORE]), c), lambda c: dec.decode([5], c)):
        _run_interrupted(model, lambda: dec.make_cache(method), op, lambda c: dec.prefill(np.asarray([PROMPT]), c))


@pytest.mark.parametrize("method", ["pqo4", "int8"])
def test_an_onnx_hook_step_failing_at_any_layer_leaves_the_cache_as_it_was(method):
    """OrtKVDecoder stores every layer's new K/V after the session run, layer by layer: a store
    that fails at any of them leaves the cache as it was (40 tokens: beyond a truncation's reach)."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from types import SimpleNamespace

    from test_onnx_hook import _decoder_graph

    from arraykv.integrations.onnxruntime import OrtKVDecoder

    dec = OrtKVDecoder(_decoder_graph())
    shim = SimpleNamespace(config=SimpleNamespace(num_layers=dec.num_layers))
    prompt, more = [t % 50 for t in PROMPT], [t % 50 for t in MORE]
    for op in (lambda c: dec.step(np.asarray([more]), c), lambda c: dec.step(np.asarray([[7]]), c)):
        _run_interrupted(shim, lambda: dec.make_cache(method), op, lambda c: dec.step(np.asarray([prompt]), c))
