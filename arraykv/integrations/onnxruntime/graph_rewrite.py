"""Find each layer's attention over the past in an ONNX decoder graph, and replace it.

A decoder exported "with past" computes, per layer ``i``::

    present.i.key   = Concat(past_key_values.i.key,   k_new, axis=2)      (b, kv_heads, total, d)
    present.i.value = Concat(past_key_values.i.value, v_new, axis=2)
    scores = MatMul(q * a, f(present.i.key) * b) * c [+ mask]              f: transpose, repeat heads
    out    = MatMul(guard(Softmax(scores)), g(present.i.value))           g: repeat heads

:func:`find_attention_sites` finds the ``Concat`` pair, the query tensor ``q`` (the left operand
of the score ``MatMul``, before any scalar it is multiplied or divided by), the softmax scale
``a * b * c`` (the scalars the query, the keys and the scores are multiplied or divided by on
the way), and ``out``. The two rewriters then replace everything between ``(q, k_new, v_new)``
and ``out``:

- :func:`rewrite_with_cache_op` puts one ``ArrayKVAttention`` node (domain
  ``ai.onnx.contrib``, run by :mod:`arraykv.integrations.onnxruntime.cache_operator`) in place of it, which
  stores ``k_new``/``v_new`` in layer ``i`` of an arraykv cache held by Python and returns the
  attention computed from that cache: the graph keeps no ``past_key_values.*`` inputs and no
  ``present.*`` outputs;
- :func:`arraykv.integrations.onnxruntime.gqa_rewrite.rewrite_with_gqa` puts ONNX Runtime's
  ``com.microsoft.GroupQueryAttention`` there instead (its own int4/int8 KV cache).

Decomposed this way, two exporters are covered: the project's own
(``examples/export_smollm2_onnx.py``: grouped queries, one constant scale on the scores) and
torch's TorchScript-based ONNX export of ``scaled_dot_product_attention`` as Optimum writes it
(``q`` and ``Kᵀ`` each multiplied by ``sqrt(scale)``; heads repeated by
``Unsqueeze``/``Expand``/``Reshape``; a boolean mask built from ``attention_mask`` turned into
``Where(mask, 0, -inf)`` and added to the scores; the Softmax followed by ``Where(IsNaN(p), 0,
p)``, which ``guard`` above stands for). A scale need not be a stored constant: one computed
from constants and static dimensions (``1 / sqrt(d)`` from ``Shape(q)``, ``Sqrt`` of a
constant) is evaluated here in the graph's own element types (:mod:`.constant_fold`), and a
product within a few float32 ulps of ``1 / sqrt(head_dim)`` is taken as exactly that (two
float32 square roots multiplied give ``0.12499999`` for ``0.125``). A scale that depends on a
symbolic dimension is refused.

Layout assumed of ``q``: ``(b, X, Y, d)`` with ``X * Y = q_heads * new_tokens`` holding the
query heads in order and, within a head, the tokens in order (``(b, q_heads, t, d)``, or the
grouped ``(b, kv_heads, groups * t, d)`` of ``examples/export_smollm2_onnx.py``); ``out`` has
``q``'s shape and layout. The mask feeding the scores is dropped: the replacement is causal
over the tokens its cache holds, which is what an ``attention_mask`` of ones means (left
padding in a batch is not supported).

The attention may also be ONNX's own ``Attention`` operator (default domain, opset 23/24), in
two forms:

- over ``present.i.*``: ``Attention(q, f(present.i.key), f(present.i.value), mask)``, the
  ``Concat`` with the past outside the operator and ``f`` at most ``repeat_kv``
  (``Unsqueeze``/``Expand``/``Reshape``; with ``enable_gqa`` none, the operator pairs the heads
  itself). This is what torch's dynamo exporter (``torch.onnx.export(..., dynamo=True,
  opset_version=23)``) writes for ``scaled_dot_product_attention``; 4-D tensors, ``is_causal=0``
  with a mask (``is_causal=1`` there aligns the mask top-left, query ``i`` seeing keys
  ``0..i`` of the whole cache, and is refused);
- with the past inside: ``Attention(q, k_new, v_new, mask?, past_key_values.i.key,
  past_key_values.i.value) -> (out, present.i.key, present.i.value)``, 4-D or 3-D ``(b, t,
  heads * d)`` (``q_num_heads``/``kv_num_heads``), causal by ``is_causal=1`` or a mask.

The scale is the ``scale`` attribute, by default ``1 / sqrt(head_dim)``; the mask is dropped
as above. 3-D tensors are brought to ``(b, heads, t, d)`` by ``Reshape``/``Transpose`` nodes
around the replacement and its output back to ``(b, t, q_heads * d)``. A ``Shape`` node that
reads the batch size (or a static dimension) from a past input, as the dynamo exporter writes
them, reads it from another input (or becomes a constant) once the past inputs are gone.

Graphs that do not have these shapes (ONNX Runtime's fused ``GroupQueryAttention``, a past
concatenated on another axis, ``present.*`` used elsewhere than in the attention, anything but
scales and masks between the score ``MatMul`` and the Softmax, an ``Attention`` with
``softcap``, its scores as an output, ``nonpad_kv_seqlen`` or a softmax coarser than float32,
non-float32 K/V) are refused with a :class:`GraphRewriteError` naming the layer and what was
found; :class:`~arraykv.integrations.onnxruntime.hook.OrtKVDecoder` (the hook) still drives them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .constant_fold import ConstantFolder
from .graph_queries import node_consumers

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
#: Operators that only move or repeat the keys/values between ``present.*`` and the MatMul. The
#: replacement pairs query head ``h`` with KV head ``h // groups`` (``repeat_kv``: Unsqueeze,
#: Expand, Reshape); ``Tile`` on the head axis pairs it with ``h % kv_heads``, so a path through
#: ``Tile`` is not followed and such a graph is refused.
_MOVE_OPS = frozenset({"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Flatten"})
#: Operators allowed between the score MatMul and the Softmax (scale and mask).
_SCORE_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity"})
#: Operators allowed between the Softmax and the value MatMul.
_PROB_OPS = frozenset({"Cast", "Identity", "Dropout"})
_MAX_DEPTH = 16
#: Operators allowed between ``present.*`` and an ONNX ``Attention`` operator's K/V inputs:
#: ``repeat_kv`` only (no Transpose: the operator takes K as ``(b, heads, T, d)``, not ``Kᵀ``).
_REPEAT_OPS = frozenset({"Reshape", "Expand", "Unsqueeze", "Identity"})
#: Inputs of ONNX's ``Attention`` (opset 23/24) after Q, K, V: mask, past key, past value,
#: and (opset 24) the valid lengths of an external, padded cache.
_MASK, _PAST_KEY, _PAST_VALUE, _NONPAD = 3, 4, 5, 6
#: Softmax precisions of ``Attention`` at least as fine as the replacement's float32.
_FINE_SOFTMAX = (0, 1, 11)
#: Relative distance within which a recovered scale is taken as ``1 / sqrt(head_dim)`` (a few float32 ulps).
_SNAP = 2.0**-20


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
        The attention output, ``query``'s shape: the output of the value ``MatMul`` or of the
        ``Attention`` operator.
    scale : float
        The factor the graph applies to ``query · key`` before the softmax.
    flat_heads : tuple of (int, int) or None
        ``(q_heads, kv_heads)`` when ``query``, ``new_key``, ``new_value`` and ``output`` are
        in the 3-D form of ONNX's ``Attention`` operator, ``(b, t, heads * head_dim)``;
        :func:`replace_sites` then brings them to the 4-D layouts above and back. None when
        they already are in those layouts.
    """

    layer: int
    query: str
    new_key: str
    new_value: str
    output: str
    scale: float
    flat_heads: tuple | None = None


def load_model_proto(model: Any) -> Any:
    """``model`` (a path, serialized bytes or an ``onnx.ModelProto``) as a ModelProto with its weights loaded."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(str(model))


def _producers(graph: Any) -> dict:
    return {o: node for node in graph.node for o in node.output if o}


def _past_layers(graph: Any) -> int:
    found: dict[int, set[str]] = {}
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
    return str(node.input[1])


def _follow_to_matmul(consumers: dict, folder: ConstantFolder, start: str, allow_scale: bool) -> tuple[Any, float]:
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
                    c = folder.scalar(other)
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


def _only_consumer(consumers: dict, name: str, layer: int, what: str) -> Any:
    nodes = consumers.get(name, [])
    if len(nodes) != 1:
        raise GraphRewriteError(f"layer {layer}: the {what} {name!r} is used by {len(nodes)} nodes, expected one")
    return nodes[0]


def _unscaled_query(producers: dict, folder: ConstantFolder, name: str) -> tuple:
    """``(q, factor)``: ``name`` is ``q`` times ``factor``, through ``Mul``/``Div`` by known scalars.

    torch's export of ``scaled_dot_product_attention`` multiplies both ``q`` and ``Kᵀ`` by
    ``sqrt(scale)`` before the score ``MatMul``; the query side of that scale is read here.
    """
    factor = 1.0
    for _ in range(_MAX_DEPTH):
        node = producers.get(name)
        if node is None or node.op_type not in ("Mul", "Div") or len(node.input) != 2:
            break
        pairs = ((1, 0), (0, 1)) if node.op_type == "Mul" else ((1, 0),)
        for k, x in pairs:
            c = folder.scalar(node.input[k])
            if c is not None and (node.op_type == "Mul" or c != 0.0):
                factor, name = (factor * c if node.op_type == "Mul" else factor / c), node.input[x]
                break
        else:
            break
    return name, factor


def _nan_guard(consumers: dict, folder: ConstantFolder, name: str) -> Any:
    """The ``Where(IsNaN(p), 0, p)`` that torch's export puts after a Softmax under a boolean mask, or None.

    A row the mask hides entirely is 0/0 = NaN after the Softmax; the guard turns it into zeros.
    The replacement attends causally over the cache, where no row is empty, so the guard goes
    with the rest.
    """
    nodes = consumers.get(name, [])
    if len(nodes) != 2:
        return None
    isnan = next((n for n in nodes if n.op_type == "IsNaN"), None)
    where = next((n for n in nodes if n.op_type == "Where"), None)
    if isnan is None or where is None or len(where.input) != 3:
        return None
    if where.input[0] != isnan.output[0] or where.input[2] != name or len(consumers.get(isnan.output[0], [])) != 1:
        return None
    return where if folder.scalar(where.input[1]) == 0.0 else None


def _exact_scale(factor: float, head_dim: Any) -> float:
    """``1 / sqrt(head_dim)`` when ``factor`` is that within float32 rounding, else ``factor``.

    The scale is often stored as float32 constants (``sqrt(1/sqrt(d))`` on each side, or
    ``1/sqrt(d)`` rounded); their product is the scale to a few float32 ulps.
    """
    if isinstance(head_dim, int) and head_dim > 0 and abs(factor * math.sqrt(head_dim) - 1.0) <= _SNAP:
        return 1.0 / math.sqrt(head_dim)
    return factor


def _is_attention(node: Any) -> bool:
    """Whether ``node`` is ONNX's standard ``Attention`` operator (opset 23 and later)."""
    return node.op_type == "Attention" and node.domain in ("", "ai.onnx")


def _follow_to_attention(consumers: dict, start: str, slot: int) -> Any:
    """The ``Attention`` node taking ``start``, through ``repeat_kv`` moves, as its input ``slot``; or None."""
    frontier, seen = [start], {start}
    for _ in range(_MAX_DEPTH):
        nxt = []
        for name in frontier:
            for node in consumers.get(name, ()):
                if _is_attention(node) and len(node.input) > slot and node.input[slot] == name:
                    return node
                if node.op_type in _REPEAT_OPS and node.input[0] == name and node.output[0] not in seen:
                    seen.add(node.output[0])
                    nxt.append(node.output[0])
        if not nxt:
            return None
        frontier = nxt
    return None


def _input(node: Any, i: int) -> str:
    """``node``'s input ``i``, or ``""`` when it is absent."""
    return node.input[i] if len(node.input) > i else ""


def _refuse_uncovered(where: str, node: Any, attrs: dict, inside: bool) -> None:
    """Raise for what an ``Attention`` operator computes and the replacement does not."""
    if attrs.get("softcap", 0.0) != 0.0:
        raise GraphRewriteError(f"{where} caps its scores (softcap={attrs['softcap']}); the replacement has no softcap")
    if len(node.output) > 3 and node.output[3]:
        raise GraphRewriteError(f"{where} also returns its scores ({node.output[3]!r}), which the replacement does not")
    if _input(node, _NONPAD):
        raise GraphRewriteError(f"{where} takes nonpad_kv_seqlen: a padded cache outside the graph, not a past input")
    if attrs.get("softmax_precision", 0) not in _FINE_SOFTMAX:
        raise GraphRewriteError(f"{where} runs its softmax in element type {attrs['softmax_precision']}, not float32")
    causal = attrs.get("is_causal", 0)
    if causal and not inside:
        raise GraphRewriteError(
            f"{where} has is_causal=1 over keys already concatenated with the past and no past input: "
            "its mask is then aligned top-left (query i sees keys 0..i, not the past; torch's is_causal=True "
            "does the same), which is not attention over a past"
        )
    if not causal and not _input(node, _MASK):
        raise GraphRewriteError(f"{where} has neither a mask nor is_causal=1: every new token sees every other")


def _fused_site(folder: ConstantFolder, layer: int, node: Any, new_k: str, new_v: str, inside: bool) -> AttentionSite:
    """The site of an ``Attention`` operator; ``inside``: it takes the past itself (``past_key``/``past_value``)."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    where = f"layer {layer}: the Attention operator {node.name or node.output[0]!r}"
    _refuse_uncovered(where, node, attrs, inside)
    dims = folder.dims(node.input[0])
    rank = len(dims) if dims is not None else (3 if "q_num_heads" in attrs else 4)
    heads = None
    if rank == 3:
        heads = (int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0)))
        if not inside or min(heads) <= 0:
            raise GraphRewriteError(
                f"{where} has 3-D inputs (b, t, heads * d); the rewriter takes them only with the past as "
                "past_key/past_value inputs and q_num_heads/kv_num_heads given"
            )
    elif rank != 4:
        raise GraphRewriteError(f"{where} has {rank}-D inputs, not 3-D or 4-D")
    head_dim = _head_dim(folder, layer, dims, heads)
    scale = attrs.get("scale")
    if scale is None:
        if head_dim is None:
            raise GraphRewriteError(f"{where} has the default scale 1/sqrt(head_dim), and head_dim is not known")
        scale = 1.0 / math.sqrt(head_dim)
    return AttentionSite(
        layer=layer,
        query=node.input[0],
        new_key=new_k,
        new_value=new_v,
        output=node.output[0],
        scale=_exact_scale(float(scale), head_dim),
        flat_heads=heads,
    )


def _head_dim(folder: ConstantFolder, layer: int, q_dims: list | None, heads: tuple | None) -> int | None:
    """The head dimension: the past keys' last dimension, else the query's (per head when it is 3-D)."""
    past = folder.dims(f"past_key_values.{layer}.key")
    if past is not None and len(past) == 4 and past[3]:
        return int(past[3])
    if q_dims is None or not q_dims[-1]:
        return None
    return int(q_dims[-1]) // (heads[0] if heads else 1)


def _attention_over_present(
    folder: ConstantFolder, layer: int, consumers: dict, producers: dict
) -> AttentionSite | None:
    """The site when ``Attention`` takes ``present.{layer}.*`` (the Concat with the past) as K/V; or None.

    This is what torch's dynamo exporter writes for ``scaled_dot_product_attention`` on keys
    and values concatenated with the past (the heads repeated or, with ``enable_gqa``, not).
    """
    node = _follow_to_attention(consumers, f"present.{layer}.key", 1)
    if node is None:
        return None
    if _follow_to_attention(consumers, f"present.{layer}.value", 2) is not node:
        raise GraphRewriteError(
            f"layer {layer}: the Attention operator {node.name or node.output[0]!r} takes present.{layer}.key "
            f"but not present.{layer}.value as its values"
        )
    if _input(node, _PAST_KEY) or _input(node, _PAST_VALUE):
        raise GraphRewriteError(f"layer {layer}: the Attention operator takes a past on top of present.{layer}.*")
    new_k = _new_tokens(producers, layer, "key")
    new_v = _new_tokens(producers, layer, "value")
    return _fused_site(folder, layer, node, new_k, new_v, inside=False)


def _attention_with_past(folder: ConstantFolder, layer: int, node: Any) -> AttentionSite:
    """The site of an ``Attention`` node that computes ``present.{layer}.key``: it must take the past inputs."""
    past = [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
    present = [f"present.{layer}.key", f"present.{layer}.value"]
    got_past = [_input(node, _PAST_KEY), _input(node, _PAST_VALUE)]
    if got_past != past or list(node.output[1:3]) != present:
        raise GraphRewriteError(
            f"layer {layer}: the Attention operator {node.name or node.output[0]!r} takes its past from "
            f"{got_past} and returns {list(node.output[1:3])}, not the graph inputs {past} and outputs {present}"
        )
    return _fused_site(folder, layer, node, node.input[1], node.input[2], inside=True)


def _site(graph: Any, consumers: dict, producers: dict, folder: ConstantFolder, layer: int) -> AttentionSite:
    node = producers.get(f"present.{layer}.key")
    if node is not None and _is_attention(node):
        return _attention_with_past(folder, layer, node)
    site = _attention_over_present(folder, layer, consumers, producers)
    if site is not None:
        return site
    return _decomposed_site(consumers, producers, folder, layer)


def _decomposed_site(consumers: dict, producers: dict, folder: ConstantFolder, layer: int) -> AttentionSite:
    new_k = _new_tokens(producers, layer, "key")
    new_v = _new_tokens(producers, layer, "value")
    score, k_factor = _follow_to_matmul(consumers, folder, f"present.{layer}.key", True)
    if score is None:
        raise GraphRewriteError(
            f"layer {layer}: no MatMul takes present.{layer}.key (through transposes, reshapes, "
            "expands and constant scales; not Tile, whose head order differs) as its right operand: "
            "a fused attention operator or a pattern the rewriter does not know"
        )
    query, q_factor = _unscaled_query(producers, folder, score.input[0])
    factor = k_factor * q_factor
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
            c = folder.scalar(other)
            if c is None or (node.op_type == "Div" and node.input[0] != name):
                raise GraphRewriteError(
                    f"layer {layer}: the scores are scaled by {other!r}, which is neither a constant "
                    "scalar nor computed from constants and static dimensions"
                )
            factor = factor * c if node.op_type == "Mul" else factor / c
        elif node.op_type == "Sub" and node.input[0] != name:
            raise GraphRewriteError(f"layer {layer}: the scores are subtracted from another tensor")
        name = node.output[0]
    else:
        raise GraphRewriteError(f"layer {layer}: no Softmax after the score MatMul")
    name = node.output[0]
    values, _ = _follow_to_matmul(consumers, folder, f"present.{layer}.value", False)
    for _ in range(_MAX_DEPTH):  # probabilities -> MatMul with the values
        guard = _nan_guard(consumers, folder, name)
        if guard is not None:
            name = guard.output[0]
            continue
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
    dims = folder.dims(f"past_key_values.{layer}.key")
    head_dim = dims[3] if dims is not None and len(dims) == 4 else None
    return AttentionSite(
        layer=layer,
        query=query,
        new_key=new_k,
        new_value=new_v,
        output=node.output[0],
        scale=_exact_scale(float(factor), head_dim),
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
    consumers, producers = node_consumers(g), _producers(g)
    folder = ConstantFolder(model, producers)
    return [_site(g, consumers, producers, folder, i) for i in range(n)]


def _unflattened(site: AttentionSite, make_nodes: Any) -> list:
    """``make_nodes(site)``, with a 3-D site's tensors brought to the 4-D layouts and its output back.

    ``(b, t, heads * d)`` becomes ``(b, heads, t, d)`` by ``Reshape`` to ``(b, t, heads, d)`` and
    ``Transpose``; the 4-D output ``(b, q_heads, t, d)`` goes back the same way.
    """
    from dataclasses import replace

    from onnx import helper, numpy_helper

    if site.flat_heads is None:
        return list(make_nodes(site))
    p = f"arraykv_flat{site.layer}_"

    def const(name: str, value: list) -> Any:
        return helper.make_node("Constant", [], [p + name], value=numpy_helper.from_array(np.array(value, np.int64)))

    q_heads, kv_heads = site.flat_heads
    nodes = [const("qshape", [0, 0, q_heads, -1]), const("kvshape", [0, 0, kv_heads, -1]), const("yshape", [0, 0, -1])]
    for part, shape in (("query", "qshape"), ("new_key", "kvshape"), ("new_value", "kvshape")):
        nodes.append(helper.make_node("Reshape", [getattr(site, part), p + shape], [p + part + "_split"]))
        nodes.append(helper.make_node("Transpose", [p + part + "_split"], [p + part], perm=[0, 2, 1, 3]))
    four = replace(
        site, query=p + "query", new_key=p + "new_key", new_value=p + "new_value", output=p + "output", flat_heads=None
    )
    nodes.extend(make_nodes(four))
    nodes.append(helper.make_node("Transpose", [p + "output"], [p + "output_t"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Reshape", [p + "output_t", p + "yshape"], [site.output]))
    return nodes


def _shape_elsewhere(node: Any, graph: Any) -> Any:
    """``node``, or, when it is a ``Shape`` reading one dimension of a past input, a node reading it elsewhere.

    torch's dynamo exporter reads a symbolic dimension (the batch) from whichever input has it,
    the past included; once the past inputs are gone, a static dimension becomes a constant and
    a symbolic one is read from another input that declares the same dimension name.
    """
    from onnx import helper, numpy_helper

    if node.op_type != "Shape" or not _PAST.match(node.input[0]):
        return node
    declared = {vi.name: vi.type.tensor_type.shape.dim for vi in graph.input}
    dims = declared.get(node.input[0], [])
    attrs = {a.name: a.i for a in node.attribute}
    start = attrs.get("start", 0) % max(len(dims), 1)
    end = attrs.get("end", len(dims))
    end = end % len(dims) if end < 0 else min(end, len(dims))
    if end - start != 1:
        return node
    dim = dims[start]
    if dim.HasField("dim_value"):
        value = numpy_helper.from_array(np.array([dim.dim_value], np.int64))
        return helper.make_node("Constant", [], list(node.output), name=node.name, value=value)
    for name, other in declared.items():
        if _PAST.match(name) or not dim.dim_param:
            continue
        for j, d in enumerate(other):
            if d.dim_param == dim.dim_param:
                return helper.make_node("Shape", [name], list(node.output), name=node.name, start=j, end=j + 1)
    return node


def replace_sites(
    model: Any, sites: list, make_nodes: Any, *, keep_kv_io: bool = False, domains: dict | None = None
) -> Any:
    """A copy of ``model`` with each site's attention replaced by ``make_nodes(site)``.

    Parameters
    ----------
    model : onnx.ModelProto
    sites : list of AttentionSite
    make_nodes : callable
        ``make_nodes(site) -> list of onnx.NodeProto`` computing ``site.output`` from
        ``site.query``, ``site.new_key`` and ``site.new_value`` (and whatever else they add);
        always given a site in the 4-D layouts (a 3-D site's tensors are converted around it).
    keep_kv_io : bool, default False
        Keep the ``past_key_values.*`` inputs and ``present.*`` outputs (the replacement then
        reads/writes them itself); by default both are removed, and ``Shape`` nodes reading a
        dimension of a past input read it elsewhere (module notes).
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
        if node.output and node.output[0] in by_output and (node.op_type == "MatMul" or _is_attention(node)):
            nodes.extend(_unflattened(by_output[node.output[0]], make_nodes))
        elif node.op_type == "Concat" and node.output and node.output[0] in concat_outs:
            continue
        else:
            nodes.append(node)
    if not keep_kv_io:
        nodes = [_shape_elsewhere(node, g) for node in nodes]
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


def rewrite_with_cache_op(model: Any, handle: str) -> Any:
    """``model`` with each layer's attention over the past replaced by an ``ArrayKVAttention`` node.

    Parameters
    ----------
    model : onnx.ModelProto
        A decoder with ``past_key_values.{i}.*`` inputs and ``present.{i}.*`` outputs, its
        attention decomposed or ONNX's ``Attention`` operator (module notes).
    handle : str
        Written into every node's ``handle`` attribute: the key under which the Python side
        registers the object holding the cache (:func:`arraykv.integrations.onnxruntime.cache_operator.register`).

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
