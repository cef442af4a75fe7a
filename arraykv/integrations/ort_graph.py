"""Find each layer's attention over the past in an ONNX decoder graph, and replace it.

A decoder exported "with past" computes, per layer ``i``::

    present.i.key   = Concat(past_key_values.i.key,   k_new, axis=2)      (b, kv_heads, total, d)
    present.i.value = Concat(past_key_values.i.value, v_new, axis=2)
    scores = MatMul(q, f(present.i.key)) * c [+ mask]                      f: transpose, repeat heads
    out    = MatMul(Softmax(scores), g(present.i.value))                   g: repeat heads

:func:`find_attention_sites` finds the ``Concat`` pair, the query tensor ``q`` (the left operand
of the score ``MatMul``), the product ``c`` of the constant scalars the keys and the scores are
multiplied or divided by on the way (the softmax scale), and ``out``. The two rewriters then
replace everything between ``(q, k_new, v_new)`` and ``out``:

- :func:`rewrite_with_cache_op` puts one ``ArrayKVAttention`` node (domain
  ``ai.onnx.contrib``, run by :mod:`arraykv.integrations.ort_cache_op`) in place of it, which
  stores ``k_new``/``v_new`` in layer ``i`` of an arraykv cache held by Python and returns the
  attention computed from that cache: the graph keeps no ``past_key_values.*`` inputs and no
  ``present.*`` outputs;
- :func:`arraykv.integrations.ort_gqa.rewrite_with_gqa` puts ONNX Runtime's
  ``com.microsoft.GroupQueryAttention`` there instead (its own int4/int8 KV cache).

Layout assumed of ``q``: ``(b, X, Y, d)`` with ``X * Y = q_heads * new_tokens`` holding the
query heads in order and, within a head, the tokens in order (``(b, q_heads, t, d)``, or the
grouped ``(b, kv_heads, groups * t, d)`` of ``examples/export_smollm2_onnx.py``); ``out`` has
``q``'s shape and layout. The mask feeding the scores is dropped: the replacement is causal
over the tokens its cache holds, which is what an ``attention_mask`` of ones means (left
padding in a batch is not supported).

Graphs that do not have this shape (a fused ``Attention``/``GroupQueryAttention`` operator,
a past concatenated on another axis, ``present.*`` used elsewhere than in the attention,
non-float32 K/V) are refused with a :class:`GraphRewriteError` naming the layer and what was
found; :class:`~arraykv.integrations.onnxruntime.OrtKVDecoder` (the hook) still drives them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .onnx_queries import node_consumers

__all__ = [
    "AttentionSite",
    "GraphRewriteError",
    "find_attention_sites",
    "rewrite_with_cache_op",
    "replace_sites",
    "load_model_proto",
    "CACHE_OP",
    "CACHE_OP_DOMAIN",
]

#: The custom operator that :func:`rewrite_with_cache_op` inserts, and its domain.
CACHE_OP = "ArrayKVAttention"
CACHE_OP_DOMAIN = "ai.onnx.contrib"

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
#: Operators that only move or repeat the keys/values between ``present.*`` and the MatMul.
_MOVE_OPS = frozenset({"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Identity", "Flatten"})
#: Operators allowed between the score MatMul and the Softmax (scale and mask).
_SCORE_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity"})
#: Operators allowed between the Softmax and the value MatMul.
_PROB_OPS = frozenset({"Cast", "Identity", "Dropout"})
_MAX_DEPTH = 16


class GraphRewriteError(ValueError):
    """The graph's attention over the past does not have the shape the rewriters replace."""


@dataclass(frozen=True)
class AttentionSite:
    """One layer's attention over its past, as found in the graph.

    Attributes
    ----------
    layer : int
    query : str
        Tensor multiplied with the keys, ``(b, X, Y, head_dim)`` (see the module notes).
    new_key, new_value : str
        The new tokens' keys and values, ``(b, kv_heads, t, head_dim)`` float32.
    output : str
        The attention output, ``query``'s shape: the output of the value ``MatMul``.
    scale : float
        The factor the graph applies to ``query · key`` before the softmax.
    """

    layer: int
    query: str
    new_key: str
    new_value: str
    output: str
    scale: float


def load_model_proto(model: Any):
    """``model`` (a path, serialized bytes or an ``onnx.ModelProto``) as a ModelProto with its weights loaded."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(str(model))


def _constants(graph: Any) -> dict:
    """The graph's one-element constants (initializers and ``Constant`` nodes) as NumPy arrays."""
    from onnx import numpy_helper

    out = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    out[node.output[0]] = a.t
    small = {name: t for name, t in out.items() if all(int(d) == 1 for d in t.dims)}  # weights are never read
    return {name: numpy_helper.to_array(t) for name, t in small.items()}


def _scalar(consts: dict, name: str) -> float | None:
    a = consts.get(name)
    if a is None or a.size != 1 or a.dtype.kind != "f":
        return None
    return float(a.reshape(()))


def _producers(graph: Any) -> dict:
    return {o: node for node in graph.node for o in node.output if o}


def _past_layers(graph: Any) -> int:
    found: dict = {}
    for vi in graph.input:
        m = _PAST.match(vi.name)
        if m:
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
    if not found:
        names = ", ".join(vi.name for vi in graph.input)
        raise GraphRewriteError(
            "the graph has no past_key_values.{i}.key/value inputs, so there is no attention "
            f"over a past to replace; inputs found: {names}"
        )
    n = max(found) + 1
    for i in range(n):
        if found.get(i) != {"key", "value"}:
            raise GraphRewriteError(f"layer {i} lacks past_key_values.{i}.key or .value among the inputs")
    return n


def _new_tokens(producers: dict, layer: int, kind: str) -> str:
    """``x_new`` of ``present.{layer}.{kind} = Concat(past_key_values.{layer}.{kind}, x_new, axis=2)``."""
    name = f"present.{layer}.{kind}"
    node = producers.get(name)
    past = f"past_key_values.{layer}.{kind}"
    if node is None:
        raise GraphRewriteError(f"the graph has {past} but no node computes {name}")
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    if node.op_type != "Concat" or list(node.input[:1]) != [past] or len(node.input) != 2 or axis not in (2, -2):
        raise GraphRewriteError(
            f"layer {layer}: {name} is computed by {node.op_type}({', '.join(node.input)}), not by "
            f"Concat({past}, new, axis=2); this graph cannot be rewritten (the hook OrtKVDecoder still drives it)"
        )
    return node.input[1]


def _follow_to_matmul(consumers: dict, consts: dict, start: str, allow_scale: bool):
    """The first ``MatMul`` whose right operand descends from ``start`` through moves (and constant scales).

    Returns ``(node, factor)``: the product of the constant scalars on the way, or ``(None, 1.0)``.
    """
    frontier = [(start, 1.0)]
    seen = {start}
    for _ in range(_MAX_DEPTH):
        nxt = []
        for name, factor in frontier:
            for node in consumers.get(name, ()):
                if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] == name:
                    return node, factor
                f = factor
                if node.op_type in ("Mul", "Div") and allow_scale:
                    other = node.input[1] if node.input[0] == name else node.input[0]
                    c = _scalar(consts, other)
                    if c is None or (node.op_type == "Div" and node.input[0] != name):
                        continue
                    f = factor * c if node.op_type == "Mul" else factor / c
                elif node.op_type not in _MOVE_OPS:
                    continue
                out = node.output[0]
                if out and out not in seen:
                    seen.add(out)
                    nxt.append((out, f))
        if not nxt:
            return None, 1.0
        frontier = nxt
    return None, 1.0


def _only_consumer(consumers: dict, name: str, layer: int, what: str):
    nodes = consumers.get(name, [])
    if len(nodes) != 1:
        raise GraphRewriteError(f"layer {layer}: the {what} {name!r} is used by {len(nodes)} nodes, expected one")
    return nodes[0]


def _site(graph: Any, consumers: dict, producers: dict, consts: dict, layer: int) -> AttentionSite:
    new_k = _new_tokens(producers, layer, "key")
    new_v = _new_tokens(producers, layer, "value")
    score, k_factor = _follow_to_matmul(consumers, consts, f"present.{layer}.key", True)
    if score is None:
        raise GraphRewriteError(
            f"layer {layer}: no MatMul takes present.{layer}.key (through transposes, reshapes "
            "and constant scales) as its right operand: a fused attention operator or a "
            "pattern the rewriter does not know"
        )
    factor = k_factor
    name = score.output[0]
    for _ in range(_MAX_DEPTH):  # scores -> Softmax through scales and masks
        node = _only_consumer(consumers, name, layer, "attention score tensor")
        if node.op_type == "Softmax":
            axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
            if axis not in (-1, 3):
                raise GraphRewriteError(f"layer {layer}: the attention Softmax runs over axis {axis}, not the last")
            break
        if node.op_type not in _SCORE_OPS:
            raise GraphRewriteError(f"layer {layer}: {node.op_type} between the score MatMul and the Softmax")
        if node.op_type in ("Mul", "Div"):
            other = node.input[1] if node.input[0] == name else node.input[0]
            c = _scalar(consts, other)
            if c is None or (node.op_type == "Div" and node.input[0] != name):
                raise GraphRewriteError(f"layer {layer}: the scores are scaled by {other!r}, not a constant scalar")
            factor = factor * c if node.op_type == "Mul" else factor / c
        elif node.op_type == "Sub" and node.input[0] != name:
            raise GraphRewriteError(f"layer {layer}: the scores are subtracted from another tensor")
        name = node.output[0]
    else:
        raise GraphRewriteError(f"layer {layer}: no Softmax after the score MatMul")
    name = node.output[0]
    values, _ = _follow_to_matmul(consumers, consts, f"present.{layer}.value", False)
    for _ in range(_MAX_DEPTH):  # probabilities -> MatMul with the values
        node = _only_consumer(consumers, name, layer, "attention probability tensor")
        if node.op_type == "MatMul":
            break
        if node.op_type not in _PROB_OPS:
            raise GraphRewriteError(f"layer {layer}: {node.op_type} between the Softmax and the value MatMul")
        name = node.output[0]
    if values is None or node is not values or node.input[0] != name:
        raise GraphRewriteError(
            f"layer {layer}: the attention probabilities are not multiplied with present.{layer}.value"
        )
    return AttentionSite(
        layer=layer, query=score.input[0], new_key=new_k, new_value=new_v, output=node.output[0], scale=float(factor)
    )


def find_attention_sites(model: Any) -> list:
    """Every layer's attention over the past in ``model``.

    Parameters
    ----------
    model : onnx.ModelProto

    Returns
    -------
    list of AttentionSite
        One per layer, in layer order.

    Raises
    ------
    GraphRewriteError
        The graph has no ``past_key_values.*`` inputs, or some layer's attention does not have
        the shape described in the module notes (the message names the layer and what it found).
    """
    g = model.graph
    n = _past_layers(g)
    for vi in g.input:
        if _PAST.match(vi.name) and vi.type.tensor_type.elem_type != 1:
            raise GraphRewriteError(
                f"{vi.name} has element type {vi.type.tensor_type.elem_type}; "
                "only float32 K/V (type 1) can be rewritten"
            )
    consumers, producers, consts = node_consumers(g), _producers(g), _constants(g)
    return [_site(g, consumers, producers, consts, i) for i in range(n)]


def replace_sites(model: Any, sites: list, make_nodes: Any, *, keep_kv_io: bool = False, domains: dict | None = None):
    """A copy of ``model`` with each site's attention replaced by ``make_nodes(site)``.

    Parameters
    ----------
    model : onnx.ModelProto
    sites : list of AttentionSite
    make_nodes : callable
        ``make_nodes(site) -> list of onnx.NodeProto`` computing ``site.output`` from
        ``site.query``, ``site.new_key`` and ``site.new_value`` (and whatever else they add).
    keep_kv_io : bool, default False
        Keep the ``past_key_values.*`` inputs and ``present.*`` outputs (the replacement then
        reads/writes them itself); by default both are removed.
    domains : dict of str to int, optional
        Operator set domains the new nodes need, added to the model's imports.

    Returns
    -------
    onnx.ModelProto
        With the nodes no output depends on any more, and their initializers, removed.
    """
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_output = {s.output: s for s in sites}
    concat_outs = {f"present.{s.layer}.{k}" for s in sites for k in ("key", "value")}
    nodes = []
    for node in g.node:
        if node.output and node.output[0] in by_output and node.op_type == "MatMul":
            nodes.extend(make_nodes(by_output[node.output[0]]))
        elif node.op_type == "Concat" and node.output and node.output[0] in concat_outs:
            continue
        else:
            nodes.append(node)
    if not keep_kv_io:
        kept_in = [vi for vi in g.input if not _PAST.match(vi.name)]
        kept_out = [vi for vi in g.output if vi.name not in concat_outs]
        del g.input[:]
        g.input.extend(kept_in)
        del g.output[:]
        g.output.extend(kept_out)
    needed = {vi.name for vi in g.output}
    live = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output if o):
            live.append(node)
            needed.update(i for i in node.input if i)
    live.reverse()
    del g.node[:]
    g.node.extend(live)
    if not keep_kv_io:
        stale = sorted(n for n in needed if _PAST.match(n) or n in concat_outs)
        if stale:
            raise GraphRewriteError(
                f"{', '.join(stale)} are still used outside the attention after the rewrite; "
                "this graph cannot lose its past inputs (the hook OrtKVDecoder still drives it)"
            )
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    vis = [vi for vi in g.value_info if vi.name in needed]
    del g.value_info[:]
    g.value_info.extend(vis)
    have = {o.domain for o in out.opset_import}
    for domain, version in (domains or {}).items():
        if domain not in have:
            out.opset_import.append(onnx.helper.make_opsetid(domain, version))
    return out


def rewrite_with_cache_op(model: Any, handle: str):
    """``model`` with each layer's attention over the past replaced by an ``ArrayKVAttention`` node.

    Parameters
    ----------
    model : onnx.ModelProto
        A decoder with ``past_key_values.{i}.*`` inputs and ``present.{i}.*`` outputs.
    handle : str
        Written into every node's ``handle`` attribute: the key under which the Python side
        registers the object holding the cache (:func:`arraykv.integrations.ort_cache_op.register`).

    Returns
    -------
    model : onnx.ModelProto
        No ``past_key_values.*`` inputs and no ``present.*`` outputs; node ``i`` has inputs
        ``(query, new_key, new_value)``, attributes ``handle``, ``layer = i`` and ``scale``.
    sites : list of AttentionSite

    Raises
    ------
    GraphRewriteError
        See :func:`find_attention_sites`.
    """
    from onnx import helper

    sites = find_attention_sites(model)

    def make(site: AttentionSite) -> list:
        return [
            helper.make_node(
                CACHE_OP,
                [site.query, site.new_key, site.new_value],
                [site.output],
                name=f"arraykv_attention_{site.layer}",
                domain=CACHE_OP_DOMAIN,
                handle=handle,
                layer=site.layer,
                scale=site.scale,
            )
        ]

    return replace_sites(model, sites, make, domains={CACHE_OP_DOMAIN: 1}), sites
