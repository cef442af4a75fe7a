"""The byte-level BPE tokenizer stored in a GGUF file's metadata, built with ``tokenizers``.

GGUF keeps the vocabulary (``tokenizer.ggml.tokens``), the merge rules
(``tokenizer.ggml.merges``), the token types (3 = control token such as ``<|im_start|>``) and
the name of the pre-tokenizer (``tokenizer.ggml.pre``). This module turns them into a
``tokenizers.Tokenizer`` with a BPE model, the pre-tokenizer that name stands for, and the
byte-level decoder.
"""

from __future__ import annotations

from typing import Any, Sequence

from .gguf import require

__all__ = ["GGUFTokenizer", "tokenizer_from_gguf"]

# GPT-2's split pattern is what ByteLevel(use_regex=True) applies; these pre-tokenizer names
# add a split of digits first (each digit its own word) as their tokenizer.json files do.
_DIGITS_FIRST = {"smollm", "codeshell", "exaone", "minerva"}
_GPT2_LIKE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion", "refact", "starcoder"}
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    """

    def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 chat_template: str | None = None):
        self._tok = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template

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
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, user: str, *, system: str | None = None) -> str:
        """A ChatML prompt (``<|im_start|>role ... <|im_end|>``) for one user message.

        SmolLM2-Instruct's template is ChatML; this writes it without a Jinja dependency.
        """
        sys_msg = system if system is not None else "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        return (f"<|im_start|>system\n{sys_msg}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                "<|im_start|>assistant\n")


def _field(reader: Any, key: str, default: Any = None):
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
        The file has no tokenizer, or one that is not byte-level BPE (``tokenizer.ggml.model``
        other than ``gpt2``).
    """
    tk = require("tokenizers")
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ValueError("the GGUF file has no tokenizer metadata; encode text elsewhere and pass token ids")
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'); pass token ids instead"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
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
            [split, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # GPT-2 pattern: right for _GPT2_LIKE, the closest known behaviour otherwise
        tok.pre_tokenizer = bl
    tok.decoder = tk.decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if int(t) == 3]
    if specials:
        tok.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in specials])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return GGUFTokenizer(
        tok,
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
