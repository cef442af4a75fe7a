"""The attention queries of an ONNX decoder graph, found and exposed as extra outputs.

A polar cache (``pq``/``pqo``/``tq``) weights its key channels by the queries' per-channel RMS
(:func:`arraykv.caches.polar_calibration.query_scale`), but an exported decoder returns only
logits and ``present.*``. This module finds, for every layer, the tensor the graph multiplies
with the layer's keys (the ``Q`` of ``MatMul(Q, Kᵀ)``) and adds it to the graph's outputs, so
that :class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder` can hand the cache the queries the
graph really used.

The search starts at ``present.{i}.key`` and follows it forward through operators that only
move, repeat, cast or scale it (``Transpose``, ``Reshape``, ``Expand``, ``Unsqueeze``, ``Tile``,
``Mul`` by a scale, ...), as grouped-query attention does when it repeats a KV head for its
query heads, until a ``MatMul`` takes it as the right-hand operand: the left-hand operand is
the layer's queries, ``(batch, q_heads, new_tokens, head_dim)``, possibly times a constant
(which the channel weights ignore: they are normalized per head). Graphs that fuse attention
into one operator (ONNX Runtime's ``GroupQueryAttention``, ``Attention``) have no such
``MatMul``; for them the search finds nothing and the hook keeps passing zero queries.
"""

from __future__ import annotations

from typing import Any

__all__ = ["node_consumers", "find_query_outputs", "expose_outputs", "with_query_outputs", "QUERY_PASS_OPS"]

#: Operators the keys pass through between ``present.{i}.key`` and the score ``MatMul``.
QUERY_PASS_OPS = frozenset(
    {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Identity", "Cast", "Mul", "Div", "Flatten"}
)
#: How many operators deep the search follows the keys.
_MAX_DEPTH = 16


def node_consumers(graph: Any) -> dict:
    """Name of every value -> the nodes of ``graph`` that take it as an input."""
    out: dict = {}
    for node in graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


def _query_of_layer(consumers: dict, key_name: str) -> str | None:
    """The left operand of the first ``MatMul`` whose right operand descends from ``key_name``."""
    frontier, seen = [key_name], {key_name}
    for _ in range(_MAX_DEPTH):
        nxt = []
        for name in frontier:
            for node in consumers.get(name, ()):
                if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] == name:
                    return str(node.input[0])
                if node.op_type in QUERY_PASS_OPS:
                    for out in node.output:
                        if out and out not in seen:
                            seen.add(out)
                            nxt.append(out)
        if not nxt:
            return None
        frontier = nxt
    return None


def find_query_outputs(model: Any, num_layers: int) -> list | None:
    """Names of the query tensors of layers ``0 .. num_layers - 1`` in ``model``, or None.

    Parameters
    ----------
    model : onnx.ModelProto
    num_layers : int

    Returns
    -------
    list of str or None
        One tensor name per layer, or None when some layer's queries are not found (a fused
        attention operator, or a pattern this search does not follow).
    """
    consumers = node_consumers(model.graph)
    names = []
    for i in range(num_layers):
        q = _query_of_layer(consumers, f"present.{i}.key")
        if q is None:
            return None
        names.append(q)
    return names


def expose_outputs(model: Any, names: list, elem_type: int) -> Any:
    """``model`` with the tensors ``names`` added to its graph outputs (element type ``elem_type``).

    The model is changed in place and returned; names already among the outputs are left as
    they are.
    """
    from onnx import helper

    have = {o.name for o in model.graph.output}
    for name in names:
        if name not in have:
            model.graph.output.append(helper.make_tensor_value_info(name, elem_type, None))
            have.add(name)
    return model


def with_query_outputs(proto: Any, required: bool) -> tuple:
    """``(model, query tensor names)``: ``proto`` with its queries exposed, or ``(None, None)``.

    Parameters
    ----------
    proto : onnx.ModelProto
        An ONNX decoder (its weights may be left in external data files: they are not read).
        Changed in place when the queries are found.
    required : bool
        Raise a ValueError instead of returning ``(None, None)`` when the queries cannot be exposed.

    Returns
    -------
    tuple
        ``(proto, names)`` when every layer's queries were found (``proto`` with them among its
        outputs), else ``(None, None)``: the model is to be used as it is.
    """
    from .kv_names import discover_kv_names

    graph_inputs = {i.name: i for i in proto.graph.input}
    try:
        n = discover_kv_names(list(graph_inputs), [o.name for o in proto.graph.output])
    except ValueError:
        return None, None  # reported with its hint once the session is made
    names = find_query_outputs(proto, n)
    if names is None:
        if required:
            raise ValueError(
                "queries=True, but the graph has no MatMul taking a layer's keys (a fused attention "
                "operator?); construct the decoder with queries='auto' or False"
            )
        return None, None
    elem = graph_inputs["past_key_values.0.key"].type.tensor_type.elem_type
    return expose_outputs(proto, names, elem), names
