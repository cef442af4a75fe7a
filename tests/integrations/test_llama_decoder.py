"""The NumPy Llama decoder on a tiny random model: cache paths, RoPE layout, generation, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import arraykv
from arraykv.integrations.decoder.model import DecoderModel, random_gguf_tensors, unpermute_qk

from tiny_models import DECODER_LLAMA as CFG, decoder


@pytest.fixture(scope="module")
def model():
    return decoder(CFG, seed=3)


@pytest.fixture
def ids(rng):
    return [int(i) for i in rng.integers(0, CFG.vocab_size, 40)]


def _teacher_forced(model, ids, cache, prefill):
    rows = [model.prefill(ids[:prefill], cache)]
    for t in ids[prefill:]:
        rows.append(model.decode(t, cache)[None, :])
    return np.concatenate(rows)


def _naive_forward(tensors, cfg, ids):
    """Loop-level Llama forward in float64 with raw GGUF rows and interleaved-pair RoPE."""
    hd = cfg.head_dim
    x = tensors["token_embd.weight"][ids].astype(np.float64)
    n = len(ids)

    def rms(v, w):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + cfg.rms_eps) * w

    def rope_pairs(v, pos):  # v: (heads, hd); GGUF layout rotates (2i, 2i+1)
        out = v.copy()
        for i in range(hd // 2):
            ang = pos * cfg.rope_theta ** (-2.0 * i / hd)
            a, b = v[:, 2 * i], v[:, 2 * i + 1]
            out[:, 2 * i] = a * math.cos(ang) - b * math.sin(ang)
            out[:, 2 * i + 1] = b * math.cos(ang) + a * math.sin(ang)
        return out

    g = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        h = rms(x, tensors[p + "attn_norm.weight"])
        q = (h @ tensors[p + "attn_q.weight"].T).reshape(n, cfg.num_heads, hd)
        k = (h @ tensors[p + "attn_k.weight"].T).reshape(n, cfg.num_kv_heads, hd)
        v = (h @ tensors[p + "attn_v.weight"].T).reshape(n, cfg.num_kv_heads, hd)
        q = np.stack([rope_pairs(q[t], t) for t in range(n)])
        k = np.stack([rope_pairs(k[t], t) for t in range(n)])
        o = np.zeros((n, cfg.num_heads, hd))
        for t in range(n):
            for hh in range(cfg.num_heads):
                s = np.array([q[t, hh] @ k[u, hh // g] for u in range(t + 1)]) / math.sqrt(hd)
                w = np.exp(s - s.max())
                w /= w.sum()
                o[t, hh] = w @ v[: t + 1, hh // g]
        x = x + o.reshape(n, -1) @ tensors[p + "attn_output.weight"].T
        h = rms(x, tensors[p + "ffn_norm.weight"])
        gg = h @ tensors[p + "ffn_gate.weight"].T
        u = h @ tensors[p + "ffn_up.weight"].T
        x = x + (gg / (1 + np.exp(-gg)) * u) @ tensors[p + "ffn_down.weight"].T
    return rms(x, tensors["output_norm.weight"]) @ tensors["token_embd.weight"].T


def test_forward_matches_loop_reference_with_gguf_rope_layout(ids):
    # The decoder un-permutes Q/K to the rotate-half layout; a float64 loop with the raw GGUF
    # rows and pairwise RoPE must give the same logits.
    tensors = random_gguf_tensors(CFG, seed=3)
    model = DecoderModel.from_gguf_tensors(CFG, tensors)
    got = model.forward(ids[:12])
    want = _naive_forward(tensors, CFG, ids[:12])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_unpermute_is_a_row_permutation_per_head(rng):
    w = rng.standard_normal((2 * 8, 5))
    u = unpermute_qk(w, 2)
    # head 0: rotate-half channel i (< 4) is GGUF row 2i; channel 4 + i is row 2i + 1
    np.testing.assert_array_equal(u[:4], w[0:8:2])
    np.testing.assert_array_equal(u[4:8], w[1:8:2])
    np.testing.assert_array_equal(u[8:12], w[8:16:2])


@pytest.mark.parametrize("prefill", [1, 5, 40])
def test_dense_cache_equals_no_cache(model, ids, prefill):
    full = model.forward(ids)
    cache = model.make_cache("dense")
    got = _teacher_forced(model, ids, cache, prefill)
    assert cache.seq_len(0) == len(ids) == cache.seq_len(CFG.num_layers - 1)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-4)


def test_prefill_in_two_chunks_equals_one(model, ids):
    a = model.make_cache("dense")
    first = model.prefill(ids[:10], a)
    second = model.prefill(ids[10:25], a)
    full = model.forward(ids[:25])
    np.testing.assert_allclose(np.concatenate([first, second]), full, rtol=0, atol=1e-4)


def test_batch_of_two_equals_each_alone(model, rng):
    ids = rng.integers(0, CFG.vocab_size, (2, 14))
    cache = model.make_cache("dense")
    lb = model.prefill(ids[:, :10], cache)
    for j in range(10, 14):
        step = model.decode(ids[:, j], cache)
        assert step.shape == (2, CFG.vocab_size)
    for b in range(2):
        single = model.make_cache("dense")
        np.testing.assert_allclose(model.prefill(ids[b, :10], single), lb[b], atol=1e-5)
        for j in range(10, 13):
            model.decode(int(ids[b, j]), single)
        np.testing.assert_allclose(model.decode(int(ids[b, 13]), single), step[b], atol=1e-5)


class _FusedDense(arraykv.DenseCache):
    """Returns Fused attention from decode, computed here; counts the calls."""

    method = "test-fused"
    fused_calls = 0

    def _decode(self, st, k, v, q, config):
        r = self._append(st, k, v)
        type(self).fused_calls += 1
        out = arraykv.attention(q, r.k, r.v, softmax_scale=config.softmax_scale)
        return arraykv.Fused(out)


class _BiasOnly(arraykv.DenseCache):
    """Hands back zero keys plus a logit_bias holding the true scaled scores."""

    method = "test-bias"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def _result(self, r, q):
        b, hkv, s, d = r.k.shape
        g = q.shape[1] // hkv
        kk = np.repeat(np.asarray(r.k), g, axis=1)
        bias = self.scale * np.einsum("bhtd,bhsd->bhts", np.asarray(q), kk)
        return arraykv.DequantResult(k=np.zeros_like(r.k), v=r.v, logit_bias=bias.astype(np.float32))

    def _prefill(self, st, k, v, q):
        return self._result(self._append(st, k, v), q)

    def _decode(self, st, k, v, q, config):
        return arraykv.Dequantized(self._result(self._append(st, k, v), q))


@pytest.mark.parametrize("cls", [_FusedDense, _BiasOnly])
def test_fused_and_logit_bias_outputs_are_honoured(model, ids, cls):
    full = model.forward(ids[:20])
    cache = cls(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)
    before = _FusedDense.fused_calls
    got = _teacher_forced(model, ids[:20], cache, 8)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-4)
    if cls is _FusedDense:
        assert _FusedDense.fused_calls - before == 12 * CFG.num_layers


def test_greedy_generation_follows_argmax(model, ids):
    out = model.generate(ids[:6], 5)
    cache = model.make_cache("dense")
    logits = model.prefill(ids[:6], cache)[-1]
    want = []
    for _ in range(5):
        want.append(int(np.argmax(logits)))
        logits = model.decode(want[-1], cache)
    assert out == want


def test_sampling_is_seeded_and_respects_top_k(model, ids):
    a = model.generate(ids[:6], 8, temperature=1.0, seed=7)
    b = model.generate(ids[:6], 8, temperature=1.0, seed=7)
    assert a == b
    # top_k=1 sampling is greedy
    assert model.generate(ids[:6], 8, temperature=0.7, top_k=1, seed=1) == model.generate(ids[:6], 8)


def test_eos_id_stops_after_the_token_and_ends_the_list(model, ids):
    greedy = model.generate(ids[:6], 5)
    assert model.generate(ids[:6], 5, eos_id=greedy[0]) == [greedy[0]]
    assert model.generate(ids[:6], 5, eos_id=greedy[0], stop_at_eos=False) == greedy


def test_teacher_forced_logits_match_a_hand_written_loop(model, ids):
    from arraykv.eval import teacher_forced

    run = teacher_forced(model, ids[:20], prefill=8)
    cache = model.make_cache("dense")
    model.prefill(ids[:8], cache)
    want = np.stack([np.asarray(model.decode(t, cache)) for t in ids[8:19]])
    np.testing.assert_array_equal(run.logits, want)


def test_streaming_callback_sees_every_token(model, ids):
    seen = []
    out = model.generate(ids[:4], 6, on_token=seen.append)
    assert seen == out and len(out) == 6


def test_bad_inputs_raise_clear_errors(model, ids):
    cache = model.make_cache("dense")
    with pytest.raises(ValueError, match="prefill"):
        model.decode(3, cache)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        model.forward([1, 2, 97])
    with pytest.raises(TypeError, match="integers"):
        model.forward(np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="context length of 96"):
        model.generate(ids[:10], 90)
    with pytest.raises(ValueError, match="context length of 96"):
        model.prefill(list(range(97)), model.make_cache("dense"))
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate("text", 3)
    with pytest.raises(TypeError, match="CompressedKVCache"):
        model.prefill(ids, object())
    used = model.make_cache("dense")
    model.prefill(ids[:3], used)
    with pytest.raises(ValueError, match="empty"):
        model.generate(ids[:3], 2, cache=used)


# -- chunked prefill ----------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 5, 7, 39, 40, 64])
def test_chunked_prefill_equals_one_shot(model, ids, chunk):
    one = model.make_cache("dense")
    want = model.prefill(ids, one)
    cache = model.make_cache("dense")
    got = model.prefill(ids, cache, chunk_size=chunk)
    assert got.shape == (len(ids), CFG.vocab_size)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    for layer in range(CFG.num_layers):
        np.testing.assert_allclose(cache.dequantize(layer).k, one.dequantize(layer).k, atol=1e-5)
        np.testing.assert_allclose(cache.dequantize(layer).v, one.dequantize(layer).v, atol=1e-5)
    np.testing.assert_allclose(model.decode(ids[0], cache), model.decode(ids[0], one), atol=1e-4)


def test_last_logits_only(model, ids, rng):
    full = model.forward(ids)
    last = model.prefill(ids, model.make_cache("dense"), chunk_size=9, logits="last")
    assert last.shape == (CFG.vocab_size,)
    np.testing.assert_allclose(last, full[-1], atol=1e-4)
    batch = rng.integers(0, CFG.vocab_size, (2, 17))
    got = model.prefill(batch, model.make_cache("dense"), chunk_size=4, logits="last")
    assert got.shape == (2, CFG.vocab_size)
    np.testing.assert_allclose(got, model.forward(batch)[:, -1], atol=1e-4)
    # continuing a cache that already holds tokens
    cache = model.make_cache("dense")
    model.prefill(ids[:11], cache)
    np.testing.assert_allclose(model.prefill(ids[11:], cache, chunk_size=6, logits="last"), full[-1], atol=1e-4)
    assert cache.seq_len(0) == len(ids)


class _CountingDense(arraykv.DenseCache):
    """Counts the tokens of every prefill call of layer 0."""

    method = "test-counting"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.chunks = []

    def prefill(self, layer, k, v, q):
        if layer == 0:
            self.chunks.append(int(k.shape[2]))
        return super().prefill(layer, k, v, q)


def test_each_chunk_is_one_cache_prefill_per_layer(model, ids):
    cache = _CountingDense(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)
    model.prefill(ids, cache, chunk_size=16, logits="last")
    assert cache.chunks == [16, 16, 8]


def test_generate_prefills_in_chunks_with_the_same_result(model, ids):
    assert model.generate(ids[:30], 5, prefill_chunk=4) == model.generate(ids[:30], 5, prefill_chunk=None)
    assert model.generate(ids[:30], 5) == model.generate(ids[:30], 5, prefill_chunk=7)


def test_bad_chunk_arguments_leave_the_cache_untouched(model, ids):
    cache = model.make_cache("dense")
    for kw, match in (
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
        ({"logits": "first"}, "logits"),
    ):
        with pytest.raises(ValueError, match=match):
            model.prefill(ids, cache, **kw)
        assert cache.seq_len(0) == 0
    with pytest.raises(ValueError, match="prefill_chunk"):
        model.generate(ids[:5], 2, prefill_chunk=0)
