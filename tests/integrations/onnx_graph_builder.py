"""Tiny decoder graphs built node by node with ``onnx.helper``, for the graph rewriter's tests.

:class:`GraphBuilder` names every node and initializer itself and reads dimensions the way an
exporter does; :meth:`GraphBuilder.embedded_tokens`, :meth:`GraphBuilder.causal_mask` and
:meth:`GraphBuilder.decoder_model` are the parts every test decoder shares: token and position
embeddings, the boolean causal-and-padding mask built from ``attention_mask`` and the past's
length, and the model with inputs ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.{i}.key/value`` and outputs ``logits``, ``present.{i}.key/value``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class GraphBuilder:
    """Nodes and initializers with generated names.

    Parameters
    ----------
    rng : numpy.random.Generator
        Draws the weights, in the order :meth:`weight` is called.
    shape_reads : {"gather", "slice"}
        How :meth:`dim` reads one dimension: ``Shape -> Gather -> Unsqueeze`` (torch's
        TorchScript-based export, Optimum's) or ``Shape(start, end)`` (the dynamo exporter).
    """

    def __init__(self, rng: np.random.Generator, *, shape_reads: str = "gather"):
        if shape_reads not in ("gather", "slice"):
            raise ValueError(f"shape_reads must be 'gather' or 'slice', received {shape_reads!r}")
        self.rng = rng
        self.shape_reads = shape_reads
        self.nodes: list = []
        self.inits: list = []
        self.n = 0

    def op(self, op_type: str, inputs: list, **attrs) -> str:
        self.n += 1
        out = f"t{self.n}_{op_type}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self.n}", **attrs))
        return out

    def const(self, value, dtype=np.int64) -> str:
        """A ``Constant`` node, as torch writes small values."""
        self.n += 1
        out = f"c{self.n}"
        self.nodes.append(
            helper.make_node("Constant", [], [out], value=numpy_helper.from_array(np.asarray(value, dtype)))
        )
        return out

    def weight(self, name: str, shape: tuple, std: float) -> str:
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * std).astype(np.float32), name))
        return name

    def dim(self, x: str, i: int) -> str:
        """``x.shape[i]`` as a one-element int64 vector, read as :attr:`shape_reads` says."""
        if self.shape_reads == "slice":
            return self.op("Shape", [x], start=i, end=i + 1)
        return self.op(
            "Unsqueeze", [self.op("Gather", [self.op("Shape", [x]), self.const(i)], axis=0), self.const([0])]
        )

    def embedded_tokens(self, vocab: int, positions: int, hidden: int) -> str:
        """``embed[input_ids] + positions[position_ids]``, (b, t, hidden); draws both tables."""
        return self.op(
            "Add",
            [
                self.op("Gather", [self.weight("embed", (vocab, hidden), 1.0), "input_ids"], axis=0),
                self.op("Gather", [self.weight("positions", (positions, hidden), 1.0), "position_ids"], axis=0),
            ],
        )

    def causal_mask(self) -> str:
        """(b, 1, t, T) boolean: key position <= query position, and ``attention_mask``; the past's
        length read from ``past_key_values.0.key``, as the exporters read it (nodes that die with
        the attention when the graph is rewritten)."""
        past = self.op("Squeeze", [self.dim("past_key_values.0.key", 2), self.const([0])])
        total = self.op("Squeeze", [self.dim("attention_mask", 1), self.const([0])])
        one, zero = self.const(1), self.const(0)
        qpos = self.op("Range", [past, total, one])
        kpos = self.op("Range", [zero, total, one])
        keys, queries = self.op("Unsqueeze", [kpos, self.const([0])]), self.op("Unsqueeze", [qpos, self.const([1])])
        causal = self.op("LessOrEqual", [keys, queries])
        padding = self.op("Unsqueeze", [self.op("Cast", ["attention_mask"], to=TensorProto.BOOL), self.const([1, 2])])
        return self.op("And", [self.op("Unsqueeze", [causal, self.const([0, 1])]), padding])

    def decoder_model(
        self,
        x: str,
        name: str,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        hidden: int,
        vocab: int,
        std: float,
        opset: int,
        ir_version: int,
    ) -> onnx.ModelProto:
        """The checked model: ``logits = x @ lm_head`` (drawn here) and the decoder's inputs and outputs."""
        self.nodes.append(helper.make_node("MatMul", [x, self.weight("lm_head", (hidden, vocab), std)], ["logits"]))
        f, i64 = TensorProto.FLOAT, TensorProto.INT64
        inputs = [
            helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
            helper.make_tensor_value_info("position_ids", i64, ["batch", "seq"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", f, ["batch", "seq", vocab])]
        for i in range(layers):
            for kind in ("key", "value"):
                inputs.append(
                    helper.make_tensor_value_info(
                        f"past_key_values.{i}.{kind}", f, ["batch", kv_heads, "past", head_dim]
                    )
                )
                outputs.append(
                    helper.make_tensor_value_info(f"present.{i}.{kind}", f, ["batch", kv_heads, "total", head_dim])
                )
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
        onnx.checker.check_model(model)
        return model
