"""arraykv.eval on a tiny random model: the metrics' definitions, bookkeeping and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import arraykv
from arraykv import eval as ev

from tiny_models import EVAL_LLAMA as CFG, decoder


@arraykv.register_method("test-noisy-f16", replace=True)
class _Float16KV(arraykv.DenseCache):
    """Keeps K/V rounded to float16 (a real, if mild, lossy cache) and counts 2 bytes a value."""

    method = "test-noisy-f16"

    def _append(self, st, k, v):
        xp = st.xp  # any namespace: the conformance suites run every registered method on several

        def f16(x):
            return xp.astype(xp.astype(x, xp.float16), x.dtype) if hasattr(xp, "float16") else x

        return super()._append(st, f16(k), f16(v))

    def _layer_nbytes(self, st):
        return super()._layer_nbytes(st) // 2


@pytest.fixture(scope="module")
def model():
    return decoder(CFG, seed=5)


@pytest.fixture
def ids(rng):
    return [int(i) for i in rng.integers(0, CFG.vocab_size, 50)]


def test_compare_matches_the_definitions(rng):
    n, vocab = 9, 13
    a = rng.standard_normal((n, vocab)).astype(np.float32)
    b = (a + 0.3 * rng.standard_normal((n, vocab))).astype(np.float32)
    tgt = rng.integers(0, vocab, n)
    exact = ev.TeacherForced("dense", a, 1.0, 4000, 20)
    run = ev.TeacherForced("x", b, 2.0, 1000, 20)
    r = ev.compare(run, exact, tgt, num_layers=2, num_kv_heads=5, head_dim=10)

    def logp(z):
        z = z.astype(np.float64)
        return z - z.max() - math.log(np.exp(z - z.max()).sum())

    kl = np.mean([np.sum(np.exp(logp(a[i])) * (logp(a[i]) - logp(b[i]))) for i in range(n)])
    ppl_b = math.exp(-np.mean([logp(b[i])[tgt[i]] for i in range(n)]))
    ppl_a = math.exp(-np.mean([logp(a[i])[tgt[i]] for i in range(n)]))
    assert r.mean_kl == pytest.approx(kl, rel=1e-9)
    assert r.perplexity == pytest.approx(ppl_b, rel=1e-9)
    assert r.ppl_change == pytest.approx(ppl_b - ppl_a, rel=1e-9)
    assert r.top1_agreement == np.mean(a.argmax(1) == b.argmax(1))
    assert r.bits_per_value == 1000 * 8 / (2 * 2 * 5 * 20 * 10)
    assert r.f16_ratio == r.bits_per_value / 16
    assert r.decode_tokens_per_s == n / 2.0
    assert r.max_abs_logit_diff == pytest.approx(float(np.abs(a - b).max()))


def test_evaluate_runs_each_method_against_dense(model, ids):
    rows = ev.evaluate(model, ids, ["test-noisy-f16", "dense"], prefill=10)
    assert [r.method for r in rows] == ["test-noisy-f16", "dense"]
    noisy, dense = rows
    assert dense.mean_kl == 0.0 and dense.top1_agreement == 1.0 and dense.ppl_change == 0.0
    assert dense.bits_per_value == 32.0 and noisy.bits_per_value == 16.0
    assert dense.decoded == noisy.decoded == len(ids) - 11 and noisy.tokens == len(ids) - 1
    assert 0.0 < noisy.mean_kl < 1e-3 and noisy.max_abs_logit_diff > 0.0
    table = ev.format_table(rows)
    assert "test-noisy-f16" in table and table.count("\n") == 3
    assert "dense" in ev.format_table(rows, markdown=False)


def test_evaluate_reuses_a_given_exact_run(model, ids):
    exact = ev.teacher_forced(model, ids, model.make_cache("dense"), prefill=10)
    (row,) = ev.evaluate(model, ids, ["dense"], prefill=10, exact=exact)
    assert row.decode_tokens_per_s == pytest.approx(exact.logits.shape[0] / exact.seconds)
    with pytest.raises(ValueError, match="same positions"):
        ev.evaluate(model, ids, ["dense"], prefill=12, exact=exact)


def test_evaluate_rejects_bad_arguments(model, ids):
    with pytest.raises(ValueError, match="unknown methods"):
        ev.evaluate(model, ids, ["no-such-method"], prefill=10)
    with pytest.raises(TypeError, match="sequence of method names"):
        ev.evaluate(model, ids, "dense", prefill=10)
    with pytest.raises(ValueError, match="not evaluated"):
        ev.evaluate(model, ids, ["dense"], prefill=10, cache_options={"pqo4": {}})
    with pytest.raises(ValueError, match="at least prefill"):
        ev.evaluate(model, ids[:11], ["dense"], prefill=10)
    with pytest.raises(ValueError, match="prefill must be"):
        ev.evaluate(model, ids, ["dense"], prefill=0)
    used = model.make_cache("dense")
    model.prefill(ids[:3], used)
    with pytest.raises(ValueError, match="empty"):
        ev.teacher_forced(model, ids, used, prefill=10)


class _CharTokenizer:
    def encode(self, text):
        return [ord(c) % 256 for c in text]


def test_builtin_text_is_long_public_domain_prose():
    text = ev.builtin_text()
    assert text.startswith("PRIDE AND PREJUDICE") and "universally acknowledged" in text
    ids = ev.builtin_token_ids(_CharTokenizer(), 600)
    assert len(ids) == 600 and ids[0] == ord("P")
    with pytest.raises(ValueError, match="fewer than"):
        ev.builtin_token_ids(_CharTokenizer(), 10**7)
    with pytest.raises(TypeError, match="encode"):
        ev.builtin_token_ids(object())


def test_calibrate_fits_every_layer_on_the_models_kv(model, rng):
    cal = [int(i) for i in rng.integers(0, CFG.vocab_size, 40)]
    fitted = ev.calibrate(model, cal, arraykv.LowRank(rank=3))
    assert len(fitted) == CFG.num_layers and all(c.fitted for c in fitted)
    dense = model.make_cache("dense")
    model.prefill(cal, dense)
    kv = dense.dequantize(1)
    want = arraykv.KVCacheCompressor(arraykv.LowRank(rank=3)).fit(kv.k, kv.v)
    np.testing.assert_allclose(np.abs(fitted[1]._fit["k"].basis), np.abs(want._fit["k"].basis), atol=1e-5)
    # The fitted list plugs into the lowrank cache: every layer encodes from its first token.
    cache = model.make_cache("lowrank", calibration=fitted, sink_tokens=0, residual_window=0)
    model.prefill(cal[:5], cache)
    assert all(cache.is_fitted(i) for i in range(CFG.num_layers))
    assert cache.layer_arrays(0)["k_coef"].shape[-1] == 3
    with pytest.raises(ValueError, match="at least 2"):
        ev.calibrate(model, cal[:1], arraykv.LowRank(rank=3))
    with pytest.raises(ValueError, match="context length"):
        ev.calibrate(model, [1] * (CFG.context_length + 1), arraykv.LowRank(rank=3))
