"""Values of an ONNX graph's tensors that are known before the graph runs.

:class:`ConstantFolder` evaluates, with NumPy, the small tensors a decoder graph computes from
constants and static dimensions: the softmax scale an exporter writes as ``1 / sqrt(d)`` from
``Shape(q)``, ``Sqrt`` of a constant, a folded constant. The graph rewriter
(:mod:`arraykv.integrations.onnxruntime.graph_rewrite`) reads its scales and tensor shapes through it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ConstantFolder"]

#: How deep :class:`ConstantFolder` follows a value's computation, and the largest initializer it reads.
_MAX_FOLD_DEPTH, _MAX_FOLD_SIZE = 32, 64


class ConstantFolder:
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
