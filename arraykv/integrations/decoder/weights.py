"""Weight layout helpers of the decoder: GGUF Q/K row order, per-block weights, the fast layout, a random model.

Kept apart from :mod:`arraykv.integrations.decoder.model` (which re-exports them) so that the decoder
module holds the forward pass only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

import numpy as np

from ..._types import Array
from .architectures import architecture
from .model_config import ModelConfig

__all__ = [
    "LAYOUT_VERSION",
    "LayerWeights",
    "layout_arrays",
    "layout_from_arrays",
    "layout_gguf_tensors",
    "random_gguf_tensors",
    "tensor_shapes",
    "unpermute_qk",
    "WeightLayout",
]

#: Version of :func:`layout_gguf_tensors`' output: a change to it must change this number, since
#: the weight cache (:mod:`arraykv.integrations.decoder.weight_cache`) holds laid-out weights.
LAYOUT_VERSION = 1


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
    bqkv : array of shape ((heads + 2 * kv_heads) * head_dim,), or None
        Q, K, V biases side by side (Qwen 2).
    q_norm, k_norm : array of shape (head_dim,), or None
        QK-norm weights (Qwen 3, Gemma 3).
    post_attn_norm, post_ffn_norm : array of shape (hidden,), or None
        Norms of the sub-blocks' outputs (Gemma 3).
    """

    attn_norm: Any
    wqkv: Any
    wo: Any
    ffn_norm: Any
    wgu: Any
    wdown: Any
    bqkv: Any = None
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None


#: A model's laid-out weights, ``(layers, embedding, output_norm, lm_head)`` (``lm_head`` None
#: for tied embeddings): the arguments of
#: :class:`~arraykv.integrations.decoder.model.DecoderModel` after its config.
WeightLayout: TypeAlias = tuple[list[LayerWeights], Array, Array, Array | None]


def layout_gguf_tensors(config: ModelConfig, tensors: dict, xp: Any) -> WeightLayout:
    """Lay out dequantized GGUF tensors for fast decoding.

    Every matrix is stored transposed and contiguous, ``(in_features, out_features)``; Q, K and
    V become one fused matrix (Q and K rows unpermuted to the rotate-half layout), gate and up
    another.

    Parameters
    ----------
    config : ModelConfig
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

    def get(name: str) -> Any:
        a = tensors.get(name)
        if a is None:
            raise ValueError(f"the model lacks tensor {name!r}; the GGUF file is incomplete or not a {c.arch} model")
        return a

    def put(a: Any) -> Array:
        return xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

    c = config
    arch = architecture(c.arch)
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        wq, wk, wv = get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")
        if arch.interleaved_qk:
            wq, wk = unpermute_qk(wq, c.num_heads), unpermute_qk(wk, c.num_kv_heads)
        if wq.shape != (qd, c.hidden_size) or wk.shape != (kd, c.hidden_size) or wv.shape != (kd, c.hidden_size):
            raise ValueError(f"layer {i}: Q/K/V shapes {wq.shape}, {wk.shape}, {wv.shape} do not match the metadata")
        layers.append(
            LayerWeights(
                attn_norm=put(get(p + "attn_norm.weight")),
                wqkv=put(np.concatenate([wq, wk, wv], axis=0).T),
                wo=put(get(p + "attn_output.weight").T),
                ffn_norm=put(get(p + "ffn_norm.weight")),
                wgu=put(np.concatenate([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")], axis=0).T),
                wdown=put(get(p + "ffn_down.weight").T),
                bqkv=put(np.concatenate([get(p + "attn_q.bias"), get(p + "attn_k.bias"), get(p + "attn_v.bias")]))
                if arch.qkv_bias
                else None,
                q_norm=put(get(p + "attn_q_norm.weight")) if arch.qk_norm else None,
                k_norm=put(get(p + "attn_k_norm.weight")) if arch.qk_norm else None,
                post_attn_norm=put(get(p + "post_attention_norm.weight")) if arch.sandwich_norms else None,
                post_ffn_norm=put(get(p + "post_ffw_norm.weight")) if arch.sandwich_norms else None,
            )
        )
    head = tensors.get("output.weight")
    return layers, put(get("token_embd.weight")), put(get("output_norm.weight")), None if head is None else put(head)


_FIELDS = tuple(f.name for f in fields(LayerWeights))


def layout_arrays(layers: list, embedding: Any, output_norm: Any, lm_head: Any) -> dict:
    """The laid-out weights (:func:`layout_gguf_tensors`' result, NumPy) as one flat dict of arrays.

    Parameters
    ----------
    layers : list of LayerWeights
    embedding, output_norm, lm_head : numpy.ndarray (``lm_head`` may be None)

    Returns
    -------
    dict of str to numpy.ndarray
        ``"embedding"``, ``"output_norm"``, ``"lm_head"`` (when present) and
        ``"layers.{i}.{field}"`` for every field of every layer that is not None.
        :func:`layout_from_arrays` is its inverse.
    """
    out = {"embedding": embedding, "output_norm": output_norm}
    if lm_head is not None:
        out["lm_head"] = lm_head
    for i, lw in enumerate(layers):
        for name in _FIELDS:
            a = getattr(lw, name)
            if a is not None:
                out[f"layers.{i}.{name}"] = a
    return out


def layout_from_arrays(config: ModelConfig, arrays: dict, xp: Any) -> WeightLayout:
    """The inverse of :func:`layout_arrays`: ``(layers, embedding, output_norm, lm_head)`` in namespace ``xp``.

    Parameters
    ----------
    config : ModelConfig
    arrays : dict of str to numpy.ndarray
        :func:`layout_arrays`' output (read-only memory maps stay as they are under NumPy).
    xp : array namespace
        Where the weights go.

    Returns
    -------
    tuple
        As :func:`layout_gguf_tensors`.

    Raises
    ------
    ValueError
        An array a layer needs is missing.
    """

    def put(name: str) -> Array:
        return xp.asarray(arrays[name])

    try:
        layers = [
            LayerWeights(
                **{name: put(f"layers.{i}.{name}") if f"layers.{i}.{name}" in arrays else None for name in _FIELDS}
            )
            for i in range(config.num_layers)
        ]
        head = put("lm_head") if "lm_head" in arrays else None
        embedding, norm = put("embedding"), put("output_norm")
    except KeyError as exc:
        raise ValueError(f"the laid-out weights lack {exc.args[0]!r}") from None
    for i, lw in enumerate(layers):
        missing = [n for n in ("attn_norm", "wqkv", "wo", "ffn_norm", "wgu", "wdown") if getattr(lw, n) is None]
        if missing:
            raise ValueError(f"the laid-out weights lack layers.{i}.{missing[0]}")
    return layers, embedding, norm, head


def tensor_shapes(config: ModelConfig) -> dict:
    """The GGUF tensors a model of ``config`` needs, by name, with their ``(out, in)`` shapes.

    ``output.weight`` is left out: it is optional (absent for tied embeddings).

    Parameters
    ----------
    config : ModelConfig

    Returns
    -------
    dict of str to tuple of int
    """
    c = config
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    one = {
        "attn_norm.weight": (c.hidden_size,),
        "attn_q.weight": (qd, c.hidden_size),
        "attn_k.weight": (kd, c.hidden_size),
        "attn_v.weight": (kd, c.hidden_size),
        "attn_output.weight": (c.hidden_size, qd),
        "ffn_norm.weight": (c.hidden_size,),
        "ffn_gate.weight": (c.ffn_size, c.hidden_size),
        "ffn_up.weight": (c.ffn_size, c.hidden_size),
        "ffn_down.weight": (c.hidden_size, c.ffn_size),
        "attn_q.bias": (qd,),
        "attn_k.bias": (kd,),
        "attn_v.bias": (kd,),
        "attn_q_norm.weight": (c.head_dim,),
        "attn_k_norm.weight": (c.head_dim,),
        "post_attention_norm.weight": (c.hidden_size,),
        "post_ffw_norm.weight": (c.hidden_size,),
    }
    names = architecture(c.arch).layer_tensors()
    shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size,)}
    for i in range(c.num_layers):
        shapes.update({f"blk.{i}.{n}": one[n] for n in names})
    return shapes


def random_gguf_tensors(config: ModelConfig, seed: int = 0) -> dict:
    """Random float32 tensors under GGUF names for ``config`` (a tiny model for tests and examples).

    Parameters
    ----------
    config : ModelConfig
    seed : int, default 0

    Returns
    -------
    dict of str to numpy.ndarray
        ``(out, in)`` matrices scaled by ``1/sqrt(in)``, norms near 1, biases near 0; tied
        embeddings. ``DecoderModel.from_gguf_tensors(config, random_gguf_tensors(config))``
        builds a model.
    """

    rng = np.random.default_rng(seed)
    c = config
    t = {}
    for name, shape in tensor_shapes(c).items():
        if name == "token_embd.weight":
            t[name] = rng.standard_normal(shape).astype(np.float32)
        elif name.endswith("norm.weight"):
            t[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            t[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            t[name] = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
    return t
