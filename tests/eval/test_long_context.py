"""Long-context evaluation: needle prompts, the shared exact prefill, results, plots and errors.

Fast tests run on a tiny random model with a character tokenizer; one slow test runs a
2048-token needle grid on SmolLM2-135M.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from arraykv import eval as ev

from tiny_models import LONG_LLAMA as CFG, CharTokenizer, decoder

SHORT = ev.NeedleTask(intro="Find the key.\n", needle=" Key {key}.", question="\nKey? ", key_digits=3, answer_tokens=4)


@pytest.fixture(scope="module")
def model():
    return decoder(CFG, seed=11, tokenizer=CharTokenizer())


def _logp(z):
    z = np.asarray(z, dtype=np.float64)
    return z - z.max() - math.log(np.exp(z - z.max()).sum())


# -- prompts -------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [120, 257, 400])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_goes_at_its_depth_and_the_length_is_exact(length, depth):
    tok = CharTokenizer()
    task = ev.NeedleTask(align="token")
    if length < 260:
        task = ev.NeedleTask(intro="Find the key.\n", needle=" Key {key}.", question="\nKey? ", align="token")
    p = task.build(tok, length, depth)
    assert p.length == length == len(p.prompt_ids) + len(p.question_ids)
    intro = tok.encode(task.intro)
    needle = tok.encode(task.needle.format(key=p.key))
    assert p.prompt_ids[: len(intro)] == intro
    assert p.prompt_ids[p.needle_start : p.needle_start + p.needle_tokens] == needle
    assert p.needle_start - len(intro) == round(depth * p.haystack_tokens)
    assert p.haystack_tokens == length - len(intro) - len(needle) - len(p.question_ids)
    # the filler around the needle is the haystack text repeated, cut to length
    hay = p.prompt_ids[len(intro) : p.needle_start] + p.prompt_ids[p.needle_start + p.needle_tokens :]
    assert hay == tok.encode(" ".join([task.haystack] * 40))[: p.haystack_tokens]
    assert p.question_ids == tok.encode(task.question)
    assert p.target_ids == tok.encode(task.answer_prefix + p.key)


class BosTokenizer(CharTokenizer):
    """Starts every text with a BOS token unless told not to, and writes a space before a
    digit as one token ``" 1"`` (as SentencePiece vocabularies merge a space into the next piece),
    so a key's tokens after ``"... is "`` differ from the key's own tokens."""

    bos_id = CharTokenizer.eos_id + 1
    space_digit = dict(zip("0123456789", range(CharTokenizer.eos_id + 2, CharTokenizer.eos_id + 12)))

    def encode(self, text, *, add_bos=True):
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text) and text[i + 1] in self.space_digit:
                ids.append(self.space_digit[text[i + 1]])
                i += 2
            else:
                ids.append(self.chars.index(text[i]))
                i += 1
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids):
        back = {v: " " + d for d, v in self.space_digit.items()}
        return "".join(back.get(i, self.chars[i] if i < len(self.chars) else "") for i in ids)


@pytest.mark.parametrize("question", ["\nKey? ", "\nKey?"])
def test_one_bos_at_the_start_and_the_key_as_it_follows_the_question(question):
    tok = BosTokenizer()
    task = ev.NeedleTask(
        intro="Find the key.\n",
        needle=" Key {key}.",
        question=question,
        key_digits=3,
        answer_prefix="" if question.endswith(" ") else " ",
    )
    p = task.build(tok, 200, 0.5)
    ids = p.prompt_ids + p.question_ids
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1  # none before the needle or the question
    assert p.length == 200 == len(ids)
    assert tok.bos_id not in p.target_ids
    joint = tok.encode(question + task.answer_prefix + p.key, add_bos=False)
    if question.endswith(" "):  # " " + "1" merge in one text: the question's own " " token came first,
        assert joint[: len(p.question_ids)] != p.question_ids  # so the key's own tokens follow it
        assert p.target_ids == tok.encode(p.key, add_bos=False) and tok.decode(p.target_ids) == p.key
    else:  # the target is what follows the question's tokens when the question and the key are one text
        assert joint[: len(p.question_ids)] == p.question_ids
        assert p.target_ids == joint[len(p.question_ids) :]
        assert p.target_ids[0] == tok.space_digit[p.key[0]]  # " 1": the space merged into the first digit


def test_sentence_alignment_moves_the_needle_back_to_a_sentence_end():
    tok = CharTokenizer()
    for depth in (0.1, 0.33, 0.5, 0.77, 0.9):
        p = ev.NeedleTask().build(tok, 400, depth)
        exact = ev.NeedleTask(align="token").build(tok, 400, depth)
        assert p.key == exact.key and p.length == 400
        before = tok.decode(p.prompt_ids[: p.needle_start])
        assert before.endswith(".") or before == ev.INTRO  # a sentence end, or the filler's start
        # at most one filler sentence earlier (" There and back again." is the longest, 22 characters)
        assert 0 <= exact.needle_start - p.needle_start <= 22


def test_keys_are_seeded_per_cell_and_configurable():
    t = ev.NeedleTask()
    assert t.key(2048, 0.5) == t.key(2048, 0.5)
    keys = {t.key(n, d) for n in (2048, 4096) for d in (0.1, 0.5, 0.9)}
    assert len(keys) == 6 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert ev.NeedleTask(seed=1).key(2048, 0.5) != t.key(2048, 0.5)
    assert len(ev.NeedleTask(key_digits=8).key(100, 0.2)) == 8
    word = ev.NeedleTask(key_format=lambda rng: ["apple", "pear", "plum"][int(rng.integers(3))])
    assert word.key(100, 0.2) in ("apple", "pear", "plum")


def test_book_haystack_is_the_shipped_text():
    tok = CharTokenizer()
    p = ev.NeedleTask(haystack="book", align="token").build(tok, 400, 0.5)
    text = ev.builtin_long_text()
    intro = len(tok.encode(ev.INTRO))
    hay = p.prompt_ids[intro : p.needle_start] + p.prompt_ids[p.needle_start + p.needle_tokens :]
    assert tok.decode(hay) == text[: p.haystack_tokens]


def test_long_text_extends_the_short_one():
    short, long = ev.builtin_text(), ev.builtin_long_text()
    assert long.startswith(short)
    assert len(long.encode()) < 60_000
    assert [f"Chapter {i}" in long for i in range(1, 8)] == [True] * 6 + [False]
    ids = ev.builtin_long_token_ids(CharTokenizer(), 30_000)
    assert CharTokenizer().decode(ids) == long[:30_000]
    assert ev.builtin_long_token_ids(CharTokenizer(), 10)[:10] == ev.builtin_token_ids(CharTokenizer(), 10)
    with pytest.raises(ValueError, match="long text has"):
        ev.builtin_long_token_ids(CharTokenizer(), 10**6)


# -- the shared exact prefill ----------------------------------------------------------------
def test_exact_prefill_transfer_equals_a_one_shot_prefill(model, rng):
    ids = [int(i) for i in rng.integers(0, CFG.vocab_size, 45)]
    exact = ev.exact_prefill(model, ids, chunk_size=7)
    assert exact.tokens == 45 and exact.cache.seq_len(0) == 45
    one = model.make_cache("dense")
    last = model.prefill(ids, one)[-1]
    np.testing.assert_allclose(exact.logits, last, atol=1e-4)
    moved = exact.fill(model.make_cache("dense"))
    for layer in range(CFG.num_layers):
        a, b = moved.dequantize(layer), one.dequantize(layer)
        np.testing.assert_allclose(a.k, b.k, atol=1e-5)
        np.testing.assert_allclose(a.v, b.v, atol=1e-5)
        k, v, q = exact.layers[layer]
        assert k.shape == (1, CFG.num_kv_heads, 45, CFG.head_dim) and q.shape == (1, CFG.num_heads, 45, CFG.head_dim)
    np.testing.assert_allclose(model.decode(5, moved), model.decode(5, one), atol=1e-4)
    # a compressed cache gets the same stored state from the chunked record as from a one-shot one
    whole = ev.exact_prefill(model, ids, chunk_size=None)
    a, b = exact.fill(model.make_cache("int8")), whole.fill(model.make_cache("int8"))
    assert a.memory_usage() == b.memory_usage() and a.seq_len(1) == 45
    for layer in range(CFG.num_layers):
        np.testing.assert_allclose(a.dequantize(layer).k, b.dequantize(layer).k, atol=1e-3)


class _Counting:
    """Wraps a cache and counts prefill (and append) calls per layer (with their token counts)."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def prefill(self, layer, k, v, q):
        self.calls.append((layer, int(k.shape[2]), int(q.shape[2])))
        return self.cache.prefill(layer, k, v, q)

    def append(self, layer, k, v, q):
        self.calls.append((layer, int(k.shape[2]), int(q.shape[2])))
        return self.cache.append(layer, k, v, q)

    def __getattr__(self, name):
        return getattr(self.cache, name)


@pytest.mark.parametrize("mode, calls", [("exact", 1), ("cache", 1), ("cache-chunks", 3)])
def test_methods_get_one_prefill_per_layer_or_the_chunks(model, monkeypatch, mode, calls):
    """exact: the dense pass's K/V/Q at once; cache: the model's prefill keeps the prompt exact and
    stores it with one append per layer; cache-chunks: one prefill per chunk."""
    made = []
    real = model.make_cache

    def make_cache(method="dense", **options):
        c = real(method, **options)
        if method != "dense":
            c = _Counting(c)
            made.append(c)
        return c

    monkeypatch.setattr(model, "make_cache", make_cache)
    res = ev.needle_grid(model, ["int8"], lengths=[300], depths=[0.5], chunk_size=128, prefill_mode=mode)
    prompt = 300 - len(ev.NeedleTask().build(CharTokenizer(), 300, 0.5).question_ids)
    first = made[0].calls
    assert len(first) == calls * CFG.num_layers
    assert sum(n for layer, n, _ in first if layer == 0) == prompt
    if mode != "cache-chunks":
        assert all(n == nq == prompt for _, n, nq in first)  # all K/V/Q of the prompt at once
    assert res.row("int8", 300, 0.5).tokens == 300


# -- the grid and its bookkeeping --------------------------------------------------------------
def test_needle_grid_rows_and_scores_on_a_tiny_model(model):
    seen = []
    res = ev.needle_grid(
        model, ["int8", "dense"], lengths=[150, 200], depths=[0.2, 0.8], task=SHORT, chunk_size=64, on_row=seen.append
    )
    assert res.methods == ("dense", "int8")
    assert tuple(seen) == res.rows  # each cell reported as it is measured
    assert len(res.rows) == 2 * 2 * 2
    assert [(r.length, r.depth, r.method) for r in res.rows[:4]] == [
        (150, 0.2, "dense"),
        (150, 0.2, "int8"),
        (150, 0.8, "dense"),
        (150, 0.8, "int8"),
    ]
    for r in res.rows:
        dense = res.row("dense", r.length, r.depth)
        assert r.exact_retrieved == dense.retrieved and r.key == dense.key
        assert r.tokens == r.length and r.key_logprob <= 0.0 and isinstance(r.answer, str)
        assert r.retrieved == (r.key in r.answer)
    assert res.row("dense", 150, 0.2).bits_per_value == 32.0
    assert res.row("int8", 200, 0.8).bits_per_value < 12.0
    # the key score equals a teacher-forced pass through the exact cache
    p = SHORT.build(model, 200, 0.8)
    cache = model.make_cache("dense")
    z = model.prefill(p.prompt_ids + p.question_ids, cache)[-1]
    want = 0.0
    for j, t in enumerate(p.target_ids):
        if j:
            z = model.decode(p.target_ids[j - 1], cache)
        want += float(_logp(z)[t])
    assert res.row("dense", 200, 0.8).key_logprob == pytest.approx(want, abs=1e-3)


def test_a_length_at_the_context_limit_leaves_room_for_the_answer(model):
    res = ev.needle_grid(model, ["int8"], lengths=[512], depths=[0.5], task=SHORT, chunk_size=128)
    room = SHORT.answer_tokens - 1  # greedy tokens decoded after the question
    for row in res.rows:
        assert row.length == 512 and row.tokens == 512 - room and row.key == SHORT.key(512, 0.5)
    assert SHORT.build(model, 512, 0.5, total=500).length == 500


class _Prompted:
    """A model whose decode favours the key once the question is in: every answer finds it."""

    def __init__(self, model, prompt):
        self.inner, self.p = model, prompt
        self.config, self.tokenizer = model.config, model.tokenizer

    def make_cache(self, method="dense", **options):
        return self.inner.make_cache(method, **options)

    def prefill(self, ids, cache, **kw):
        return self.inner.prefill(ids, cache, **kw)

    def decode(self, tok, cache):
        z = np.array(self.inner.decode(tok, cache))
        j = cache.seq_len(0) - self.p.length
        if 0 <= j < len(self.p.target_ids):
            z[self.p.target_ids[j]] += 50.0
        return z


@pytest.mark.parametrize("answer_tokens", [2, 6])
def test_an_answer_on_the_key_path_is_scored_without_a_second_pass(model, answer_tokens):
    task = ev.NeedleTask(intro="", needle=" Key {key}.", question="\nKey? ", key_digits=4, answer_tokens=answer_tokens)
    fake = _Prompted(model, task.build(model, 120, 0.5))
    res = ev.needle_grid(fake, ["dense"], lengths=[120], depths=[0.5], task=task)
    (row,) = res.rows
    key = task.key(120, 0.5)
    assert row.answer.startswith(key[:answer_tokens]) and row.retrieved == (answer_tokens >= 4)
    assert -1e-3 < row.key_logprob <= 0.0  # every key token boosted by 50 nats


def test_summary_counts_only_cells_the_exact_cache_retrieves():
    def row(method, depth, hit, exact_hit, lp=-0.5, bits=32.0):
        return ev.NeedleRow(
            method=method,
            length=1000,
            depth=depth,
            key="1",
            answer="",
            retrieved=hit,
            exact_retrieved=exact_hit,
            key_logprob=lp,
            bits_per_value=bits,
            kv_bytes=0,
            tokens=1000,
            needle_start=0,
            seconds=0.0,
        )

    rows = (
        row("dense", 0.1, True, True),
        row("q", 0.1, True, True, -1.0, 4.0),
        row("dense", 0.5, False, False),
        row("q", 0.5, True, False, -2.0, 4.5),
        row("dense", 0.9, True, True),
        row("q", 0.9, False, True, -3.0, 4.5),
    )
    res = ev.NeedleResult(
        rows=rows,
        methods=("dense", "q"),
        lengths=(1000,),
        depths=(0.1, 0.5, 0.9),
        prefill_mode="exact",
        task=ev.NeedleTask(),
    )
    dense, q = res.summary()
    assert (dense.retrieved, dense.exact_cells, dense.retrieved_where_exact) == (2, 2, 2)
    assert (q.cells, q.retrieved, q.exact_cells, q.retrieved_where_exact) == (3, 2, 2, 1)
    assert q.mean_key_logprob == pytest.approx(-2.0) and q.bits_per_value == pytest.approx(4 + 1 / 3)
    table = res.format_grid()
    lines = table.splitlines()
    assert lines[0] == (
        "| method | 1000@10% | 1000@50% | 1000@90% | retrieved | where exact | mean log p(key) | bits/value @1000 |"
    )
    assert lines[3] == "| q | ✓ -1.00 | (✓ -2.00) | ✗ -3.00 | 2/3 | 1/2 | -2.000 | 4.33 |"
    assert "where exact" in res.format_grid(markdown=False).splitlines()[0]
    with pytest.raises(KeyError, match="no row"):
        res.row("q", 2000, 0.1)


# -- long text ---------------------------------------------------------------------------------
def test_long_text_quality_rows(model):
    res = ev.long_text_quality(model, ["int8"], prefix_lengths=(100, 300), positions=20, chunk_size=64)
    assert res.methods == ("dense", "int8") and len(res.rows) == 4
    dense = res.rows_at(100)[0]
    assert dense.method == "dense" and dense.mean_kl == 0.0 and dense.top1_agreement == 1.0
    assert dense.tokens == 120 and dense.decoded == 20 and dense.bits_per_value == 32.0
    q = res.rows_at(300)[1]
    assert q.method == "int8" and q.tokens == 320 and q.mean_kl >= 0.0 and q.bits_per_value < 12.0
    assert [p for p, _ in res.series("int8")] == [100, 300]
    lines = res.format_table().splitlines()
    assert lines[0].startswith("| method | prefix | bits/value |") and len(lines) == 6
    # same numbers as the teacher-forced tools on the same text
    ids = ev.builtin_long_token_ids(model, 321)
    exact = model.make_cache("dense")
    model.prefill(ids[:300], exact)
    ref = np.stack([model.decode(t, exact) for t in ids[300:320]])
    nll = -np.mean([_logp(ref[j])[ids[301 + j]] for j in range(20)])
    assert res.rows_at(300)[0].perplexity == pytest.approx(math.exp(nll), rel=1e-4)


def test_long_text_cache_mode_and_custom_ids(model, rng):
    ids = [int(i) for i in rng.integers(0, CFG.vocab_size, 90)]
    res = ev.long_text_quality(
        model, ["dense", "int8"], prefix_lengths=[64], positions=16, token_ids=ids, chunk_size=16, prefill_mode="cache"
    )
    assert [r.method for r in res.rows] == ["dense", "int8"] and res.prefill_mode == "cache"


# -- errors --------------------------------------------------------------------------------------
def test_bad_arguments_raise_clear_errors(model):
    grid = dict(lengths=[150], depths=[0.5], task=SHORT)
    with pytest.raises(TypeError, match="not a single string"):
        ev.needle_grid(model, "dense", **grid)
    with pytest.raises(ValueError, match="unknown methods"):
        ev.needle_grid(model, ["nope"], **grid)
    with pytest.raises(ValueError, match="more than once"):
        ev.needle_grid(model, ["int8", "int8"], **grid)
    with pytest.raises(ValueError, match="cannot name 'dense'"):
        ev.needle_grid(model, ["dense"], cache_options={"dense": {}}, **grid)
    with pytest.raises(ValueError, match="not evaluated"):
        ev.needle_grid(model, ["dense"], cache_options={"int8": {}}, **grid)
    with pytest.raises(ValueError, match="prefill_mode"):
        ev.needle_grid(model, ["dense"], prefill_mode="fast", **grid)
    with pytest.raises(ValueError, match="chunk_size"):
        ev.needle_grid(model, ["dense"], chunk_size=0, **grid)
    with pytest.raises(TypeError, match="NeedleTask"):
        ev.needle_grid(model, ["dense"], lengths=[150], task={"seed": 1})
    with pytest.raises(ValueError, match="context length of 512"):
        ev.needle_grid(model, ["dense"], lengths=[513], depths=[0.5], task=SHORT)
    with pytest.raises(ValueError, match=r"depths: depth must be a number in \[0, 1\]"):
        ev.needle_grid(model, ["dense"], lengths=[150], depths=[1.5], task=SHORT)
    with pytest.raises(ValueError, match="lengths holds duplicates"):
        ev.needle_grid(model, ["dense"], lengths=[150, 150], depths=[0.5], task=SHORT)
    with pytest.raises(ValueError, match="no room for filler"):
        ev.needle_grid(model, ["dense"], lengths=[20], depths=[0.5], task=SHORT)
    bare = decoder(CFG, seed=11)
    with pytest.raises(ValueError, match="no tokenizer"):
        ev.needle_grid(bare, ["dense"], **grid)
    with pytest.raises(ValueError, match="must contain"):
        ev.NeedleTask(needle="no key here")
    with pytest.raises(ValueError, match="key_digits"):
        ev.NeedleTask(key_digits=0)
    with pytest.raises(ValueError, match="align"):
        ev.NeedleTask(align="word")
    with pytest.raises(TypeError, match="question must be a str"):
        ev.NeedleTask(question=3)
    with pytest.raises(ValueError, match="exceed the model's context length"):
        ev.long_text_quality(model, ["int8"], prefix_lengths=[500], positions=20)
    with pytest.raises(ValueError, match="positions"):
        ev.long_text_quality(model, ["int8"], prefix_lengths=[100], positions=0)
    with pytest.raises(ValueError, match="at least"):
        ev.long_text_quality(model, ["int8"], prefix_lengths=[100], positions=10, token_ids=list(range(50)))
    with pytest.raises(ValueError, match="prefix_lengths"):
        ev.long_text_quality(model, ["int8"], prefix_lengths=[100, 100], positions=10)
    exact = ev.exact_prefill(model, [1, 2, 3], record=False)
    with pytest.raises(ValueError, match="record=True"):
        exact.fill(model.make_cache("dense"))
    full = ev.exact_prefill(model, [1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        full.fill(full.cache)


# -- plot ------------------------------------------------------------------------------------------
def test_plot_writes_a_png(model, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (extra [plot]) is not installed")
    grid = ev.needle_grid(model, ["int8"], lengths=[150, 200], depths=[0.3, 0.7], task=SHORT)
    kl = ev.long_text_quality(model, ["int8"], prefix_lengths=(100, 200), positions=8)
    path = ev.plot_long_context(tmp_path / "long.png", needle=grid, long_text=kl, title="tiny")
    data = (tmp_path / "long.png").read_bytes()
    assert path.endswith("long.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    ev.plot_long_context(tmp_path / "kl.png", long_text=kl)
    assert (tmp_path / "kl.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="pass needle"):
        ev.plot_long_context(tmp_path / "none.png")
    with pytest.raises(TypeError, match="NeedleResult"):
        ev.plot_long_context(tmp_path / "bad.png", needle=kl)


# -- the real model -------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_finds_the_key_at_2048_tokens_through_pqo4():
    from smollm import smollm_or_skip

    res = ev.needle_grid(smollm_or_skip(), ["pqo4"], lengths=[2048], depths=(0.1, 0.5, 0.9))
    dense, pqo4 = res.summary()
    report = "\n" + res.format_grid()
    assert dense.retrieved >= 2, report
    assert pqo4.retrieved_where_exact == dense.retrieved, report
    assert pqo4.bits_per_value < 5.0 and dense.bits_per_value == 32.0, report
