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
  ``ai.onnx.contrib``, run by :mod:`arraykv.integrations.ort_cache_op`) in place of it, which
  stores ``k_new``/``v_new`` in layer ``i`` of an arraykv cache held by Python and returns the
  attention computed from that cache: the graph keeps no ``past_key_values.*`` inputs and no
  ``present.*`` outputs;
- :func:`arraykv.integrations.ort_gqa.rewrite_with_gqa` puts ONNX Runtime's
  ``com.microsoft.GroupQueryAttention`` there instead (its own int4/int8 KV cache).

Two exporters are covered: the project's own (``examples/export_smollm2_onnx.py``: grouped
queries, one constant scale on the scores) and torch's ONNX export of
``scaled_dot_product_attention`` as Optimum writes it (``q`` and ``Kᵀ`` each multiplied by
``sqrt(scale)``; heads repeated by ``Unsqueeze``/``Expand``/``Reshape``; a boolean mask built
from ``attention_mask`` turned into ``Where(mask, 0, -inf)`` and added to the scores; the
Softmax followed by ``Where(IsNaN(p), 0, p)``, which ``guard`` above stands for). A scale need
not be a stored constant: one computed from constants and static dimensions (``1 / sqrt(d)``
from ``Shape(q)``, ``Sqrt`` of a constant) is evaluated here in the graph's own element types,
and a product within a few float32 ulps of ``1 / sqrt(head_dim)`` is taken as exactly that
(two float32 square roots multiplied give ``0.12499999`` for ``0.125``). A scale that depends
on a symbolic dimension is refused.

Layout assumed of ``q``: ``(b, X, Y, d)`` with ``X * Y = q_heads * new_tokens`` holding the
query heads in order and, within a head, the tokens in order (``(b, q_heads, t, d)``, or the
grouped ``(b, kv_heads, groups * t, d)`` of ``examples/export_smollm2_onnx.py``); ``out`` has
``q``'s shape and layout. The mask feeding the scores is dropped: the replacement is causal
over the tokens its cache holds, which is what an ``attention_mask`` of ones means (left
padding in a batch is not supported).

Graphs that do not have this shape (a fused ``Attention``/``GroupQueryAttention`` operator,
a past concatenated on another axis, ``present.*`` used elsewhere than in the attention,
anything but scales and masks between the score ``MatMul`` and the Softmax, non-float32 K/V)
are refused with a :class:`GraphRewriteError` naming the layer and what was
found; :class:`~arraykv.integrations.onnxruntime.OrtKVDecoder` (the hook) still drives them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

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
#: How deep :class:`_Folder` follows a scale's computation, and the largest initializer it reads.
_MAX_FOLD_DEPTH, _MAX_FOLD_SIZE = 32, 64
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


class _Folder:
    """Values of graph tensors known before the graph runs: constants, arithmetic on constants,
    and the static dimensions a ``Shape`` node reads.

    Exporters write the softmax scale in several forms: a constant, ``1 / sqrt(d)`` computed from
    ``Shape(q)`` (torch's decomposition of ``scaled_dot_product_attention`` when no scale is
    given), ``Sqrt`` of a constant applied to both ``q`` and ``Kᵀ``. :meth:`scalar` evaluates any
    of these with NumPy, in the graph's own element types. A dimension that is symbolic (batch,
    sequence) stays unknown, and so does every value computed from it. Shapes come from the
    model's declared inputs, outputs and ``value_info``, and when those lack one, from ONNX shape
    inference over a copy of the graph without its large weights (run once, when first needed).
    """

    _UNARY: dict = {"Sqrt": np.sqrt, "Reciprocal": np.reciprocal, "Neg": np.negative, "Abs": np.abs}
    _BINARY: dict = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract, "Pow": np.power}

    def __init__(self, model: Any, producers: dict):
        self._model = model
        self._producers = producers
        self._inits = {t.name: t for t in model.graph.initializer}
        self._memo: dict = {}
        self._types: dict | None = None
        self._inferred = False

    def scalar(self, name: str) -> float | None:
        """``name`` as a float when it is a one-element floating-point value known before the run."""
        a = self.value(name)
        if a is None or a.size != 1 or a.dtype.kind != "f":
            return None
        return float(a.reshape(()))

    def value(self, name: str, depth: int = 0) -> np.ndarray | None:
        """``name``'s value as a NumPy array (``object`` dtype with None for unknown dimensions), or None."""
        if name in self._memo:
            return self._memo[name]  # type: ignore[no-any-return]
        if depth > _MAX_FOLD_DEPTH:
            return None
        out: np.ndarray | None = None
        try:
            got = self._compute(name, depth)
            out = None if got is None else np.asarray(got)  # np.take of one element gives a scalar
        except (ValueError, TypeError, IndexError, KeyError, OverflowError, ZeroDivisionError):
            out = None
        self._memo[name] = out
        return out

    def _known(self, name: str, depth: int) -> np.ndarray | None:
        """``value(name)`` when every element is known (a numeric array), else None."""
        a = self.value(name, depth + 1)
        if a is None:
            return None
        if a.dtype == object:
            if any(x is None for x in a.flat):
                return None
            a = a.astype(np.int64)
        return a

    def _compute(self, name: str, depth: int) -> Any:
        from onnx import helper, numpy_helper

        t = self._inits.get(name)
        if t is not None:
            return numpy_helper.to_array(t) if int(np.prod(t.dims)) <= _MAX_FOLD_SIZE else None
        node = self._producers.get(name)
        if node is None:
            return None
        op = node.op_type
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Constant":
            for key, val in attrs.items():
                if key == "value":
                    return numpy_helper.to_array(val)
                if key in ("value_float", "value_floats"):
                    return np.asarray(val, np.float32)
                if key in ("value_int", "value_ints"):
                    return np.asarray(val, np.int64)
            return None
        if op == "Shape":
            dims = self.dims(node.input[0])
            if dims is None:
                return None
            rank = len(dims)
            start, end = attrs.get("start", 0), attrs.get("end", rank)
            dims = dims[slice(start, end)]
            out = np.array(dims, dtype=object)
            return out if any(d is None for d in dims) else out.astype(np.int64)
        if op in ("Gather", "Slice", "Unsqueeze", "Squeeze", "Reshape", "Concat"):
            return self._move(op, node, attrs, depth)
        if op in self._UNARY or op == "Identity":
            a = self._known(node.input[0], depth)
            if a is None:
                return None
            return a if op == "Identity" else self._UNARY[op](a)
        if op in self._BINARY or op == "Div":
            a, b = self._known(node.input[0], depth), self._known(node.input[1], depth)
            if a is None or b is None:
                return None
            if op == "Div":
                if a.dtype.kind in "iu" and b.dtype.kind in "iu":
                    return (np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))).astype(np.result_type(a, b))
                return np.divide(a, b)
            return self._BINARY[op](a, b)
        if op in ("Cast", "CastLike"):
            a = self._known(node.input[0], depth)
            if a is None:
                return None
            to = attrs.get("to") if op == "Cast" else self._elem_type(node.input[1])
            if to is None:
                return None
            return a.astype(helper.tensor_dtype_to_np_dtype(int(to)))
        return None

    def _move(self, op: str, node: Any, attrs: dict, depth: int) -> Any:
        """Gather, Slice, Unsqueeze, Squeeze, Reshape, Concat: on values whose elements may be unknown."""
        data = self.value(node.input[0], depth + 1)
        if data is None:
            return None

        def ints(i: int) -> list | None:
            if len(node.input) <= i or not node.input[i]:
                return None
            a = self._known(node.input[i], depth)
            if a is None or a.dtype.kind not in "iu":
                raise ValueError("not a constant integer input")
            return [int(x) for x in a.reshape(-1)]

        if op == "Gather":
            idx = self._known(node.input[1], depth)
            if idx is None:
                return None
            return np.take(data, idx, axis=attrs.get("axis", 0))
        if op == "Slice":
            starts, ends = ints(1), ints(2)
            if starts is None or ends is None:
                return None
            index = [slice(None)] * data.ndim
            for s, e, ax, st in zip(starts, ends, ints(3) or range(len(starts)), ints(4) or [1] * len(starts)):
                index[ax] = slice(s, e, st)
            return data[tuple(index)]
        if op in ("Unsqueeze", "Squeeze"):
            axes: list | None = ints(1) if len(node.input) > 1 else attrs.get("axes")
            if op == "Unsqueeze":
                if axes is None:
                    return None
                rank = data.ndim + len(axes)
                return np.expand_dims(data, tuple(a % rank for a in axes))
            if axes is None:
                return np.squeeze(data)
            return np.squeeze(data, tuple(a % data.ndim for a in axes))
        if op == "Reshape":
            shape = ints(1)
            if shape is None:
                return None
            if not attrs.get("allowzero", 0):
                shape = [data.shape[i] if s == 0 else s for i, s in enumerate(shape)]
            return np.reshape(data, shape)
        parts = []
        for i in node.input:
            p = self.value(i, depth + 1)
            if p is None:
                return None
            parts.append(p)
        if any(p.dtype == object for p in parts):
            parts = [p.astype(object) for p in parts]
        return np.concatenate(parts, axis=attrs.get("axis", 0))

    def dims(self, name: str) -> list | None:
        """The dimensions of ``name`` (None for a symbolic one), or None when its rank is unknown."""
        info = self._type_info(name)
        return None if info is None else info[1]

    def _elem_type(self, name: str) -> int | None:
        info = self._type_info(name)
        return None if info is None else info[0]

    def _type_info(self, name: str) -> tuple | None:
        """``(element type, dims or None)`` of ``name``, or None when not even its type is known."""
        if self._types is None:
            self._types = {}
            self._read_types(self._model.graph)
            for t in self._model.graph.initializer:
                self._types[t.name] = (t.data_type, [int(d) for d in t.dims])
        assert self._types is not None
        info = self._types.get(name)
        if (info is None or info[1] is None) and not self._inferred:
            self._inferred = True
            self._read_types(_infer_without_weights(self._model).graph)
            info = self._types.get(name)
        return info

    def _read_types(self, graph: Any) -> None:
        types: dict = self._types if self._types is not None else {}
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            tt = vi.type.tensor_type
            if not tt.elem_type:
                continue
            dims = None
            if tt.HasField("shape"):
                dims = [int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim]
            old = types.get(vi.name)
            if old is None or old[1] is None:
                types[vi.name] = (tt.elem_type, dims)


def _infer_without_weights(model: Any) -> Any:
    """``model`` shape-inferred (with data propagation), its large initializers declared as inputs."""
    import onnx

    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    g = light.graph
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    declared = {vi.name for vi in model.graph.input}
    for t in model.graph.initializer:
        if int(np.prod(t.dims)) <= _MAX_FOLD_SIZE:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    try:
        return onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a best effort; without it dimensions stay unknown
        return light


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


def _follow_to_matmul(consumers: dict, folder: _Folder, start: str, allow_scale: bool):
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


def _only_consumer(consumers: dict, name: str, layer: int, what: str):
    nodes = consumers.get(name, [])
    if len(nodes) != 1:
        raise GraphRewriteError(f"layer {layer}: the {what} {name!r} is used by {len(nodes)} nodes, expected one")
    return nodes[0]


def _unscaled_query(producers: dict, folder: _Folder, name: str) -> tuple:
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


def _nan_guard(consumers: dict, folder: _Folder, name: str) -> Any:
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


def _site(graph: Any, consumers: dict, producers: dict, folder: _Folder, layer: int) -> AttentionSite:
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
    folder = _Folder(model, producers)
    return [_site(g, consumers, producers, folder, i) for i in range(n)]


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
