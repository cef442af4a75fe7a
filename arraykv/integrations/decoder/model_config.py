"""The hyper-parameters of a decoder model, shared by every architecture.

:func:`arraykv.integrations.decoder.gguf_reader.read_gguf` fills one from a file's metadata; the decoder, its
weight layout and the GGUF writer read it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder, read from GGUF metadata.

    Attributes
    ----------
    num_layers, hidden_size, ffn_size, num_heads, num_kv_heads, head_dim, vocab_size : int
    context_length : int
        The longest sequence the model was trained for.
    rope_theta : float
        RoPE base frequency (of the global layers).
    rms_eps : float
        RMSNorm epsilon.
    name : str
        ``general.name`` from the metadata.
    arch : str
        The architecture (:data:`arraykv.integrations.decoder.architectures.ARCHITECTURES`).
    layer_types : tuple of str
        Per layer ``"full_attention"`` or ``"sliding_attention"``; empty means all global.
    sliding_window : int
        The sliding layers' span (0 when there are none).
    rope_local_theta : float
        RoPE base of the sliding layers.
    """

    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    name: str = "llama"
    arch: str = "llama"
    layer_types: tuple = ()
    sliding_window: int = 0
    rope_local_theta: float = 10000.0

    @property
    def n_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def kinds(self) -> tuple:
        """Per layer ``"full_attention"`` or ``"sliding_attention"`` (all global when none are listed)."""
        return self.layer_types or ("full_attention",) * self.num_layers

    @property
    def hybrid(self) -> bool:
        """Whether some layers attend through a sliding window."""
        return "sliding_attention" in self.layer_types

    def window_of(self, layer: int) -> int:
        """The attention span of ``layer``: ``sliding_window`` for a sliding layer, else 0 (unbounded)."""
        return self.sliding_window if self.kinds[layer] == "sliding_attention" else 0
