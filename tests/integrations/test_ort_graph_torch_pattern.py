"""The graph rewriter on attention written the way torch's ONNX export writes it (Optimum's exports).

A tiny 2-layer decoder is built node by node with ``onnx.helper`` in the form torch gives
``scaled_dot_product_attention`` (``torch/onnx/.../symbolic_opset14.py``) and Optimum's export
of SmolLM2 has: query, key and value reshaped with shapes read from ``Shape`` nodes and
transposed to ``(b, heads, t, d)``; the past concatenated on axis -2; the KV heads repeated by
``Unsqueeze``/``Expand``/``Reshape``; ``q`` and ``Kᵀ`` each multiplied by ``sqrt(scale)``; a
boolean causal-and-padding mask built from ``attention_mask`` and the past's length, turned into
``Where(mask, 0, -inf)`` and added; the Softmax followed by ``Where(IsNaN(p), 0, p)``;
``position_ids`` as an input. The scale comes in four forms: folded constants (what Optimum's
export holds), computed from ``Shape(q)`` (torch's ``_attention_scale``, no constant folding;
also in the dynamo exporter's form, with ``CastLike``), and a division of the scores by
``sqrt`` of the query's last dimension.

The rewritten graph (``OrtGraphDecoder``, dense cache) must give the float graph's logits when
that graph is run with its past fed back (``OrtPastLoop``).
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")

from onnx import TensorProto, helper  # noqa: E402

from arraykv.integrations.onnxruntime.gqa_rewrite import OrtPastLoop, rewrite_with_gqa  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402
from arraykv.integrations.onnxruntime.graph_rewrite import (  # noqa: E402
    CACHE_OP,
    GraphRewriteError,
    find_attention_sites,
    rewrite_with_cache_op,
)

from onnx_graph_builder import GraphBuilder  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, POSITIONS = 2, 4, 2, 8, 53, 64
HIDDEN = HEADS * HEAD_DIM
PROMPT, STEPS = 12, 6
INT64_MAX = np.iinfo(np.int64).max


def _heads(b: GraphBuilder, x: str, w: str, heads: int) -> str:
    """``x @ w`` as (b, heads, t, d): Reshape to a shape read from ``x``, then Transpose."""
    shape = b.op("Concat", [b.dim(x, 0), b.dim(x, 1), b.const([-1]), b.const([HEAD_DIM])], axis=0)
    return b.op("Transpose", [b.op("Reshape", [b.op("MatMul", [x, w]), shape])], perm=[0, 2, 1, 3])


def _repeat(b: GraphBuilder, kv: str, how: str = "expand") -> str:
    """repeat_kv: (b, kv, T, d) -> Unsqueeze(2) -> Expand(b, kv, g, T, d) -> Reshape (b, kv * g, T, d).

    ``how="tile"``: ``Tile(kv, (1, g, 1, 1))`` instead, which pairs query head ``h`` with KV head
    ``h % kv`` rather than ``h // g``.
    """
    if how == "tile":
        return b.op("Tile", [kv, b.const([1, HEADS // KV_HEADS, 1, 1])])
    dims = [b.dim(kv, i) for i in range(4)]
    groups = b.const([HEADS // KV_HEADS])
    expanded = b.op(
        "Expand", [b.op("Unsqueeze", [kv, b.const([2])]), b.op("Concat", [*dims[:2], groups, *dims[2:]], axis=0)]
    )
    heads = b.op("Mul", [dims[1], groups])
    return b.op("Reshape", [expanded, b.op("Concat", [dims[0], heads, dims[2], dims[3]], axis=0)])


def _scaled(b: GraphBuilder, q: str, kt: str, scale: str) -> tuple:
    """The score MatMul's operands and what multiplies its output, for each form of the scale."""
    if scale == "folded":
        c = float(np.sqrt(np.float32(1.0 / np.sqrt(HEAD_DIM))))
        return b.op("Mul", [q, b.const(c, np.float32)]), b.op("Mul", [kt, b.const(c, np.float32)]), None
    if scale == "from_shape":  # torch's _attention_scale, then Sqrt on both sides
        last = b.op("Slice", [b.op("Shape", [q]), b.const([-1]), b.const([INT64_MAX])])
        emb = b.op("Cast", [last], to=TensorProto.FLOAT)
        s = b.op("Cast", [b.op("Div", [b.const([1.0], np.float32), b.op("Sqrt", [emb])])], to=TensorProto.FLOAT)
        root = b.op("Sqrt", [s])
        return b.op("Mul", [q, root]), b.op("Mul", [kt, root]), None
    if scale == "castlike":  # the same in the dynamo exporter's form (torchlib's _attention_scale)
        last = b.op("CastLike", [b.op("Gather", [b.op("Shape", [q]), b.const([-1])], axis=0), q])
        s = b.op("Div", [b.op("CastLike", [b.const(1.0, np.float32), q]), b.op("Sqrt", [last])])
        root = b.op("Sqrt", [s])
        return b.op("Mul", [q, root]), b.op("Mul", [kt, root]), None
    index = {"on_scores": -1, "symbolic": -2}[scale]  # -2: the token count, unknown before the run
    d = b.op("Gather", [b.op("Shape", [q]), b.const(index)], axis=0)
    return q, kt, b.op("Sqrt", [b.op("Cast", [d], to=TensorProto.FLOAT)])


def build_torch_style_decoder(scale: str = "folded", *, guard_fill: float = 0.0, seed: int = 0, repeat: str = "expand"):
    """A 2-layer decoder ``(input_ids, attention_mask, position_ids, past) -> (logits, present)``."""
    b = GraphBuilder(np.random.default_rng(seed))  # Shape -> Gather -> Unsqueeze, as torch's export reads
    std = 1.0 / np.sqrt(HIDDEN)
    x = b.embedded_tokens(VOCAB, POSITIONS, HIDDEN)
    mask = b.causal_mask()  # the past's length read from past_key_values.0.key, as Optimum's export reads it
    for i in range(LAYERS):
        q = _heads(b, x, b.weight(f"wq{i}", (HIDDEN, HIDDEN), 3 * std), HEADS)
        k = _heads(b, x, b.weight(f"wk{i}", (HIDDEN, KV_HEADS * HEAD_DIM), 3 * std), KV_HEADS)
        v = _heads(b, x, b.weight(f"wv{i}", (HIDDEN, KV_HEADS * HEAD_DIM), std), KV_HEADS)
        for name, new in (("key", k), ("value", v)):
            b.nodes.append(
                helper.make_node("Concat", [f"past_key_values.{i}.{name}", new], [f"present.{i}.{name}"], axis=-2)
            )
        kt = b.op("Transpose", [_repeat(b, f"present.{i}.key", repeat)], perm=[0, 1, 3, 2])
        qs, ks, divide = _scaled(b, q, kt, scale)
        scores = b.op("MatMul", [qs, ks])
        if divide is not None:
            scores = b.op("Div", [scores, divide])
        bias = b.op("Where", [mask, b.const([0.0], np.float32), b.const([-np.inf], np.float32)])
        p = b.op("Softmax", [b.op("Add", [scores, bias])], axis=-1)
        p = b.op("Where", [b.op("IsNaN", [p]), b.const([guard_fill], np.float32), p])
        o = b.op("MatMul", [p, _repeat(b, f"present.{i}.value", repeat)])
        o = b.op("Reshape", [b.op("Transpose", [o], perm=[0, 2, 1, 3]), b.const([0, 0, -1])])
        x = b.op("Add", [x, b.op("MatMul", [o, b.weight(f"wo{i}", (HIDDEN, HIDDEN), std)])])
    return b.decoder_model(
        x,
        "torch_style_decoder",
        layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden=HIDDEN,
        vocab=VOCAB,
        std=std,
        opset=18,
        ir_version=9,
    )


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(5).integers(0, VOCAB, PROMPT + STEPS)


def _run(engine, ids, cache):
    """Logits (PROMPT + STEPS, vocab): the prompt in one prefill, then one decode per token."""
    first = np.asarray(engine.prefill(ids[:PROMPT], cache)).reshape(PROMPT, -1)
    rest = [np.asarray(engine.decode(int(t), cache)).reshape(-1) for t in ids[PROMPT:]]
    return np.concatenate([first, np.stack(rest)])


@pytest.mark.parametrize("scale", ["folded", "from_shape", "castlike", "on_scores"])
def test_torch_style_attention_is_found_with_its_exact_scale(scale):
    model = build_torch_style_decoder(scale)
    sites = find_attention_sites(model)
    assert [s.layer for s in sites] == [0, 1]
    assert [s.scale for s in sites] == [1 / np.sqrt(HEAD_DIM)] * 2  # exactly: no float32 rounding left
    producers = {o: n for n in model.graph.node for o in n.output}
    for s in sites:
        assert producers[s.query].op_type == "Transpose"  # the query before its sqrt(scale) factor
        assert producers[s.output].op_type == "MatMul"
        assert [producers[s.new_key].op_type, producers[s.new_value].op_type] == ["Transpose", "Transpose"]


@pytest.mark.parametrize("scale", ["folded", "from_shape", "on_scores"])
def test_rewritten_torch_style_graph_matches_the_float_graph_with_its_past(scale, ids):
    model = build_torch_style_decoder(scale)
    rewritten, _ = rewrite_with_cache_op(model, "h")
    ops = {n.op_type for n in rewritten.graph.node}
    assert CACHE_OP in ops and not ops & {"Softmax", "IsNaN", "Range", "LessOrEqual"}  # the mask is gone too
    assert [i.name for i in rewritten.graph.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in rewritten.graph.output] == ["logits"]
    plain = OrtPastLoop(model)
    ref = _run(plain, ids, plain.make_cache())
    dec = OrtGraphDecoder(model)
    assert (dec.num_layers, dec.num_kv_heads, dec.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    cache = dec.make_cache("dense")
    got = _run(dec, ids, cache)
    assert cache.seq_len(0) == cache.seq_len(1) == len(ids)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


def test_gqa_rewrite_of_the_torch_style_graph_matches_it(ids):
    model = build_torch_style_decoder("folded")
    plain = OrtPastLoop(model)
    ref = _run(plain, ids, plain.make_cache())
    gqa = OrtPastLoop(rewrite_with_gqa(model, num_heads=HEADS, bits=None))
    assert np.abs(_run(gqa, ids, gqa.make_cache()) - ref).max() < 1e-4 * np.abs(ref).max()


def test_a_batch_of_two_is_two_single_runs(ids):
    dec = OrtGraphDecoder(build_torch_style_decoder("from_shape"))
    other = np.random.default_rng(6).integers(0, VOCAB, len(ids))
    cache = dec.make_cache("dense")
    both = dec.prefill(np.stack([ids, other])[:, :PROMPT], cache)
    for row, seq in enumerate((ids, other)):
        assert np.abs(both[row] - dec.prefill(seq[:PROMPT], dec.make_cache("dense"))[0]).max() < 1e-5


def test_what_the_torch_pattern_does_not_cover_is_refused():
    with pytest.raises(GraphRewriteError, match="neither a constant scalar nor computed from constants and static"):
        find_attention_sites(build_torch_style_decoder("symbolic"))  # a scale that depends on the token count
    with pytest.raises(GraphRewriteError, match="layer 0: the attention probability tensor .* used by 2 nodes"):
        find_attention_sites(build_torch_style_decoder(guard_fill=1.0))  # not the NaN guard: NaN -> 1, not 0
    with pytest.raises(GraphRewriteError, match="not Tile, whose head order differs"):
        find_attention_sites(build_torch_style_decoder(repeat="tile"))  # heads paired h % kv, not h // groups
