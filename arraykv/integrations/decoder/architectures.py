"""Decoder architectures as small descriptions: what differs between Llama, Qwen and Gemma blocks.

Every supported model is the same pre-norm decoder (embedding, blocks of attention and a gated
feed-forward, a final norm and an output head); an :class:`Architecture` names only what
differs, and :class:`~arraykv.integrations.decoder.model.DecoderModel` reads it:

========  ==========  ========  =======  ==========  =========  ===========  ===============
arch      Q/K rows    QKV bias  QK-norm  sandwich    gate act.  embed scale  sliding layers
========  ==========  ========  =======  ==========  =========  ===========  ===============
llama     interleaved no        no       no          SiLU       no           none
qwen2     rotate-half yes       no       no          SiLU       no           none
qwen3     rotate-half no        yes      no          SiLU       no           none
gemma3    rotate-half no        yes      yes         GELU-tanh  sqrt(hidden) 5 of every 6
========  ==========  ========  =======  ==========  =========  ===========  ===============

"Interleaved" is the GGUF converter's per-head row permutation of Llama's Q/K (undone on
loading, :func:`~arraykv.integrations.decoder.weights.unpermute_qk`); the others are stored in
the rotate-half order already. "Sandwich" norms normalize the attention and feed-forward
outputs again before they are added to the residual stream (Gemma 2/3). Gemma's GGUF norm
weights already hold ``1 + w`` (the converter adds the one), so every norm here is
``x / rms(x) * w``. QK-norm is an RMSNorm over each head's channels of Q and K, before RoPE.
Gemma 3's sliding layers use a local RoPE base (10 000) and its global layers the file's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Architecture", "ARCHITECTURES", "architecture", "periodic_layer_types"]


@dataclass(frozen=True)
class Architecture:
    """What one decoder family does differently from Llama.

    Attributes
    ----------
    name : str
        ``general.architecture`` of its GGUF files.
    interleaved_qk : bool
        Q/K rows are stored in the GGUF converter's interleaved-pair order.
    qkv_bias : bool
        Q, K and V projections have biases (``attn_q.bias`` ...).
    qk_norm : bool
        RMSNorm per head over Q and K (``attn_q_norm`` / ``attn_k_norm``) before RoPE.
    sandwich_norms : bool
        ``post_attention_norm`` and ``post_ffw_norm`` on each sub-block's output.
    activation : {"silu", "gelu_tanh"}
        The gate's activation in the gated feed-forward block.
    embed_scale : bool
        Embeddings multiplied by ``sqrt(hidden_size)``.
    sliding_period : int
        0: every layer attends globally. ``n``: layer ``i`` is global when ``(i + 1) % n == 0``
        and sliding otherwise (Gemma 3: 6).
    """

    name: str
    interleaved_qk: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    sliding_period: int = 0

    def layer_tensors(self) -> tuple:
        """GGUF tensor suffixes of one block (``blk.{i}.`` + suffix), in the order they are checked."""
        names = [
            "attn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        ]
        if self.qkv_bias:
            names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.qk_norm:
            names += ["attn_q_norm.weight", "attn_k_norm.weight"]
        if self.sandwich_norms:
            names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
        return tuple(names)


ARCHITECTURES = {
    "llama": Architecture("llama", interleaved_qk=True),
    "qwen2": Architecture("qwen2", qkv_bias=True),
    "qwen3": Architecture("qwen3", qk_norm=True),
    "gemma3": Architecture(
        "gemma3", qk_norm=True, sandwich_norms=True, activation="gelu_tanh", embed_scale=True, sliding_period=6
    ),
}


def architecture(name: str) -> Architecture:
    """The description of ``name``, or a ValueError that lists the supported ones."""
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ValueError(f"architecture {name!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch


def periodic_layer_types(num_layers: int, period: int = 6) -> tuple:
    """Per layer ``"sliding_attention"`` or ``"full_attention"``: every ``period``-th layer is global."""
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers))
