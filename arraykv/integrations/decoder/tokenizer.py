"""The tokenizer stored in a GGUF file's metadata, built with ``tokenizers``.

Two kinds are supported (``tokenizer.ggml.model``):

- ``gpt2``, byte-level BPE: GGUF keeps the vocabulary (``tokenizer.ggml.tokens``), the merge
  rules (``tokenizer.ggml.merges``), the token types (3 = control token such as
  ``<|im_start|>``) and the name of the pre-tokenizer (``tokenizer.ggml.pre``). This module
  turns them into a BPE model, the pre-tokenizer that name stands for, and the byte-level
  decoder.
- ``llama``, SentencePiece BPE (Gemma, Llama 2): the vocabulary with one score per token
  (``tokenizer.ggml.scores``), no merge list, spaces written as "\u2581" and byte tokens
  ``<0x00>`` .. ``<0xFF>`` for characters outside the vocabulary. Encoding repeatedly merges
  the adjacent pair whose merged piece has the highest score. That is a BPE model whose merges
  are every split of a token into two vocabulary pieces, ranked by the token's score, with
  byte fallback; the normalizer writes spaces as "\u2581" (after a leading one when
  ``tokenizer.ggml.add_space_prefix`` says so) and the decoder undoes it. Control and
  user-defined tokens (types 3 and 4, such as ``<start_of_turn>``) are matched whole in text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..common.optional import require

__all__ = ["GGUFTokenizer", "tokenizer_from_gguf"]

# GPT-2's split pattern is what ByteLevel(use_regex=True) applies; these pre-tokenizer names
# add a split of digits first (each digit its own word) as their tokenizer.json files do.
_DIGITS_FIRST = {"smollm", "codeshell", "exaone", "minerva"}
_GPT2_LIKE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion", "refact", "starcoder"}
_SPACE = "\u2581"  # how SentencePiece writes a space
# end-of-turn tokens of chat formats: generation stops after them as after the EOS token
_END_OF_TURN = ("<end_of_turn>",)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFTokenizer:
    """Encode text to token ids and back.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
    bos_id, eos_id : int or None
        Special token ids from the metadata.
    add_bos : bool
        Whether :meth:`encode` prepends ``bos_id`` by default (``tokenizer.ggml.add_bos_token``).
    chat_template : str or None
        The Jinja chat template from the metadata (not rendered here).
    stop_ids : iterable of int, optional
        Every token that ends a generated answer: ``eos_id`` and the chat format's end-of-turn
        token (Gemma's ``<end_of_turn>``); by default ``eos_id`` alone.

    Attributes
    ----------
    stop_ids : tuple of int
        ``eos_id`` first (when there is one), then the other stop tokens, without repeats.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None = None,
        stop_ids: Iterable[int] | None = None,
    ):
        self._tok = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        ids = ([] if eos_id is None else [int(eos_id)]) + [int(i) for i in (stop_ids or ())]
        self.stop_ids = tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        """Number of tokens, special tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_bos: bool | None = None) -> list:
        """Token ids of ``text``.

        Parameters
        ----------
        text : str
        add_bos : bool, optional
            Prepend the BOS token; defaults to the model's ``add_bos_token`` setting.

        Returns
        -------
        list of int
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, received {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids (a sequence of ints or a 1-D integer array)."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token ids must be in [0, {n}), received {bad[:5]}")
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def chat_prompt(self, user: str, *, system: str | None = None) -> str:
        """A chat prompt for one user message, without a Jinja dependency.

        With ``<start_of_turn>`` in the vocabulary it is Gemma's form
        (``<start_of_turn>user ... <end_of_turn>``, the system message, if any, opening the user
        turn, then an open ``model`` turn); otherwise ChatML (``<|im_start|>role ...
        <|im_end|>``, SmolLM2-Instruct's template, with its default system message).
        :meth:`encode` adds the BOS token where the model wants one.
        """
        if self._tok.token_to_id("<start_of_turn>") is not None:
            head = f"{system}\n\n" if system else ""
            return f"<start_of_turn>user\n{head}{user}<end_of_turn>\n<start_of_turn>model\n"
        default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        sys_msg = system if system is not None else default
        return f"<|im_start|>system\n{sys_msg}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def tokenizer_from_gguf(reader: Any) -> GGUFTokenizer:
    """Build the tokenizer of a GGUF file from its metadata.

    Parameters
    ----------
    reader : gguf.GGUFReader

    Returns
    -------
    GGUFTokenizer

    Raises
    ------
    ValueError
        The file has no tokenizer, or one that is neither byte-level BPE nor SentencePiece BPE
        (``tokenizer.ggml.model`` other than ``gpt2`` and ``llama``).
    """
    tk = require("tokenizers")
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ValueError("the GGUF file has no tokenizer metadata; encode text elsewhere and pass token ids")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2', and SentencePiece BPE, "
            "'llama'); pass token ids instead"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    build = _byte_level_bpe if kind == "gpt2" else _sentencepiece_bpe
    tok = build(tk, reader, tokens, types)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    stops = [i for i in (_field(reader, "tokenizer.ggml.eot_token_id"),) if i is not None]
    if kind == "llama":
        stops += [i for i in map(tok.token_to_id, _END_OF_TURN) if i is not None and int(types[i]) == 3]
    return GGUFTokenizer(
        tok,
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        stop_ids=stops,
    )


def _byte_level_bpe(tk: Any, reader: Any, tokens: list, types: list) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``gpt2`` (byte-level BPE) vocabulary."""
    merges = _field(reader, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if sep:
            pairs.append((a, b))
    model = tk.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tok = tk.Tokenizer(model)
    pre = str(_field(reader, "tokenizer.ggml.pre", "default")).lower()
    bl = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True), bl])
    elif pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        split = tk.pre_tokenizers.Split(tk.Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False)
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
            [split, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:  # GPT-2 pattern: right for _GPT2_LIKE, the closest known behaviour otherwise
        tok.pre_tokenizer = bl
    tok.decoder = tk.decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if int(t) == 3]
    if specials:
        tok.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list:
    """The BPE merges equivalent to SentencePiece BPE over ``tokens`` and their ``scores``.

    Every split of a token into two vocabulary pieces is a merge; merges are ranked by the
    merged token's score, highest first (ties: lower token id, then shorter left piece), so a
    BPE model applying the lowest-ranked adjacent pair first merges the pair whose merged piece
    scores highest.

    Parameters
    ----------
    tokens : sequence of str
    scores : sequence of float
        One per token.

    Returns
    -------
    list of (str, str)
    """

    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id of a repeated piece
    merges: list[tuple[str, str]] = []
    add = merges.append
    for i in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable").tolist():
        t = tokens[i]
        if len(t) < 2 or vocab[t] != i:
            continue
        for k in range(1, len(t)):
            a = t[:k]
            if a in vocab:
                b = t[k:]
                if b in vocab:
                    add((a, b))
    return merges


def _sentencepiece_bpe(tk: Any, reader: Any, tokens: list, types: list) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``llama`` (SentencePiece BPE) vocabulary."""
    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is None:  # no scores: earlier tokens merge first
        scores = [-float(i) for i in range(len(tokens))]
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    model = tk.models.BPE(
        vocab={t: i for i, t in reversed(list(enumerate(tokens)))},
        merges=_spm_merges(tokens, scores),
        unk_token=None if unk is None else tokens[int(unk)],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = tk.Tokenizer(model)
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    replace = tk.normalizers.Replace(" ", _SPACE)
    tok.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [tk.decoders.Replace(_SPACE, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    if prefix:
        steps.append(tk.decoders.Strip(" ", 1, 0))
    tok.decoder = tk.decoders.Sequence(steps)
    # control (3) and unknown (2) tokens are special; user-defined ones (4) are plain text
    # pieces, such as runs of newlines, that are nonetheless matched whole
    added = [
        tk.AddedToken(tokens[i], special=int(t) != 4, normalized=False)
        for i, t in enumerate(types)
        if int(t) in (2, 3, 4)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok
