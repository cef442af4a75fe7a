"""Weight layout helpers of the Llama decoder: GGUF Q/K row order, per-block weights, the fast layout, a random model.

Kept apart from :mod:`arraykv.integrations.llama` (which re-exports them) so that the decoder
module holds the forward pass only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .gguf import LlamaConfig

__all__ = ["LayerWeights", "layout_gguf_tensors", "random_gguf_tensors", "tensor_shapes", "unpermute_qk"]


def unpermute_qk(w: Any, heads: int) -> Any:
    """Undo the GGUF converter's per-head row permutation of a Q or K projection.

    Parameters
    ----------
    w : numpy.ndarray, shape (heads * head_dim, hidden)
        Rows as stored in GGUF, where RoPE rotates adjacent pairs ``(2i, 2i+1)``.
    heads : int

    Returns
    -------
    numpy.ndarray, same shape
        Rows in the rotate-half layout, where RoPE pairs channel ``i`` with ``i + head_dim/2``.
    """
    rows, cols = w.shape
    if heads < 1 or rows % heads or (rows // heads) % 2:
        raise ValueError(f"a Q/K projection of {rows} rows does not split into {heads} heads of an even size")
    hd = rows // heads
    return w.reshape(heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


@dataclass
class LayerWeights:
    """One decoder block, matrices laid out ``(in_features, out_features)``, float32.

    Attributes
    ----------
    attn_norm : array, shape (hidden,)
    wqkv : array, shape (hidden, (heads + 2 * kv_heads) * head_dim)
        Q, K, V projections side by side; Q/K in the rotate-half layout.
    wo : array, shape (heads * head_dim, hidden)
    ffn_norm : array, shape (hidden,)
    wgu : array, shape (hidden, 2 * ffn)
        Gate and up projections side by side.
    wdown : array, shape (ffn, hidden)
    """

    attn_norm: Any
    wqkv: Any
    wo: Any
    ffn_norm: Any
    wgu: Any
    wdown: Any


def layout_gguf_tensors(config: LlamaConfig, tensors: dict, xp: Any) -> tuple:
    """Lay out dequantized GGUF tensors for fast decoding.

    Every matrix is stored transposed and contiguous, ``(in_features, out_features)``; Q, K and
    V become one fused matrix (Q and K rows unpermuted to the rotate-half layout), gate and up
    another.

    Parameters
    ----------
    config : LlamaConfig
    tensors : dict of str to numpy.ndarray
        GGUF tensor names (``blk.{i}.attn_q.weight`` ...) to float32 ``(out, in)`` arrays.
    xp : array namespace
        Where the weights go.

    Returns
    -------
    layers : list of LayerWeights
    embedding : array, shape (vocab, hidden), float32
    output_norm : array, shape (hidden,), float32
    lm_head : array of shape (vocab, hidden), or None for tied embeddings

    Raises
    ------
    ValueError
        A tensor is missing or the Q/K/V shapes disagree with ``config``.
    """
    import numpy as np

    def get(name):
        a = tensors.get(name)
        if a is None:
            raise ValueError(f"the model lacks tensor {name!r}; the GGUF file is incomplete or not a Llama model")
        return a

    def put(a):
        return xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

    c = config
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        wq = unpermute_qk(get(p + "attn_q.weight"), c.num_heads)
        wk = unpermute_qk(get(p + "attn_k.weight"), c.num_kv_heads)
        wv = get(p + "attn_v.weight")
        if wq.shape != (qd, c.hidden_size) or wk.shape != (kd, c.hidden_size) or wv.shape != (kd, c.hidden_size):
            raise ValueError(f"layer {i}: Q/K/V shapes {wq.shape}, {wk.shape}, {wv.shape} do not match the metadata")
        layers.append(LayerWeights(
            attn_norm=put(get(p + "attn_norm.weight")),
            wqkv=put(np.concatenate([wq, wk, wv], axis=0).T),
            wo=put(get(p + "attn_output.weight").T),
            ffn_norm=put(get(p + "ffn_norm.weight")),
            wgu=put(np.concatenate([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")], axis=0).T),
            wdown=put(get(p + "ffn_down.weight").T),
        ))
    head = tensors.get("output.weight")
    return layers, put(get("token_embd.weight")), put(get("output_norm.weight")), None if head is None else put(head)


def tensor_shapes(config: LlamaConfig) -> dict:
    """The GGUF tensors a Llama model of ``config`` needs, by name, with their ``(out, in)`` shapes.

    ``output.weight`` is left out: it is optional (absent for tied embeddings).

    Parameters
    ----------
    config : LlamaConfig

    Returns
    -------
    dict of str to tuple of int
    """
    c = config
    shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size,)}
    for i in range(c.num_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (c.hidden_size,),
            p + "attn_q.weight": (c.num_heads * c.head_dim, c.hidden_size),
            p + "attn_k.weight": (c.num_kv_heads * c.head_dim, c.hidden_size),
            p + "attn_v.weight": (c.num_kv_heads * c.head_dim, c.hidden_size),
            p + "attn_output.weight": (c.hidden_size, c.num_heads * c.head_dim),
            p + "ffn_norm.weight": (c.hidden_size,),
            p + "ffn_gate.weight": (c.ffn_size, c.hidden_size),
            p + "ffn_up.weight": (c.ffn_size, c.hidden_size),
            p + "ffn_down.weight": (c.hidden_size, c.ffn_size),
        })
    return shapes


def random_gguf_tensors(config: LlamaConfig, seed: int = 0) -> dict:
    """Random float32 tensors under GGUF names for ``config`` (a tiny model for tests and examples).

    Parameters
    ----------
    config : LlamaConfig
    seed : int, default 0

    Returns
    -------
    dict of str to numpy.ndarray
        ``(out, in)`` matrices scaled by ``1/sqrt(in)``, norms near 1; tied embeddings.
        ``LlamaModel.from_gguf_tensors(config, random_gguf_tensors(config))`` builds a model.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    c = config

    def mat(out, inp):
        return (rng.standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": rng.standard_normal((c.vocab_size, c.hidden_size)).astype(np.float32),
         "output_norm.weight": norm(c.hidden_size)}
    for i in range(c.num_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(c.hidden_size)
        t[p + "attn_q.weight"] = mat(c.num_heads * c.head_dim, c.hidden_size)
        t[p + "attn_k.weight"] = mat(c.num_kv_heads * c.head_dim, c.hidden_size)
        t[p + "attn_v.weight"] = mat(c.num_kv_heads * c.head_dim, c.hidden_size)
        t[p + "attn_output.weight"] = mat(c.hidden_size, c.num_heads * c.head_dim)
        t[p + "ffn_norm.weight"] = norm(c.hidden_size)
        t[p + "ffn_gate.weight"] = mat(c.ffn_size, c.hidden_size)
        t[p + "ffn_up.weight"] = mat(c.ffn_size, c.hidden_size)
        t[p + "ffn_down.weight"] = mat(c.hidden_size, c.ffn_size)
    return t
