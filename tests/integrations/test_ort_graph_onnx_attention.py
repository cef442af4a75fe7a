"""The graph rewriter on decoders whose attention is ONNX's standard ``Attention`` operator (opset 23).

Two forms are built node by node with ``onnx.helper``:

- ``present``: what torch's dynamo exporter writes for ``scaled_dot_product_attention`` on keys
  and values concatenated with the past (torch 2.14, onnxscript 0.7, transformers 5.24 Llama):
  ``present.i.* = Concat(past_key_values.i.*, new, axis=-2)`` outside the operator, the KV
  heads repeated by ``Unsqueeze``/``Expand``/``Reshape`` (or, as ``enable_gqa=True`` writes it,
  not repeated), ``Attention(Q, K, V, mask)`` on 4-D tensors with ``is_causal=0`` and a boolean
  causal-and-padding mask, the batch size of the query reshapes read from a past input's shape;
- ``inside``: the operator's own cache update, ``Attention(Q, K, V, "", past_key, past_value)
  -> (Y, present_key, present_value)`` with ``is_causal=1``, on 4-D tensors or on 3-D ones
  ``(b, t, heads * d)`` with ``q_num_heads``/``kv_num_heads``.

The rewritten graph (``OrtGraphDecoder``) must give the float graph's logits when that graph is
run with its past fed back (``OrtPastLoop``): equal with a ``dense`` cache, close with ``pqo4``.
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

LAYERS, HEADS, HEAD_DIM, VOCAB, POSITIONS = 2, 4, 16, 61, 64
HIDDEN = HEADS * HEAD_DIM
PROMPT, STEPS = 12, 6
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _repeat(b: GraphBuilder, kv: str, kv_heads: int, batch: str) -> str:
    """repeat_kv as the dynamo exporter writes it: Unsqueeze(2), Expand, Reshape to (b, q_heads, T, d)."""
    groups = HEADS // kv_heads
    total = b.dim(kv, 2)
    shape5 = b.op("Concat", [batch, b.const([kv_heads, groups]), total, b.const([HEAD_DIM])], axis=0)
    expanded = b.op("Expand", [b.op("Unsqueeze", [kv, b.const([2])]), shape5])
    shape4 = b.op("Concat", [batch, b.const([HEADS]), total, b.const([HEAD_DIM])], axis=0)
    return b.op("Reshape", [expanded, shape4], allowzero=1)


def build_attention_decoder(
    form: str = "present",
    *,
    kv_heads: int = 2,
    flat: bool = False,
    scale: float | None = 0.25,
    repeat: bool = True,
    seed: int = 0,
    attention: dict | None = None,
    past_through: str | None = None,
):
    """A decoder ``(input_ids, attention_mask, position_ids, past) -> (logits, present)`` whose
    attention is ONNX's ``Attention``; ``form`` is ``"present"`` or ``"inside"`` (module notes).

    ``attention`` adds or overrides attributes of every ``Attention`` node; ``past_through``
    (``"inside"`` only) passes layer 0's past through that operator before the ``Attention``.
    """
    b = GraphBuilder(np.random.default_rng(seed), shape_reads="slice")  # Shape(start, end), as the exporter reads
    std = 1.0 / np.sqrt(HIDDEN)
    x = b.embedded_tokens(VOCAB, POSITIONS, HIDDEN)
    # the batch read from the last past input, the KV head count from the first (as the exporter does)
    batch = b.dim(f"past_key_values.{LAYERS - 1}.value", 0)
    seq = b.dim("input_ids", 1)
    kv_count = b.dim("past_key_values.0.key", 1)
    mask = b.causal_mask() if form == "present" else ""
    kv_dim = kv_heads * HEAD_DIM
    attrs = {} if scale is None else {"scale": scale}
    attrs.update(attention or {})
    for i in range(LAYERS):
        proj = [
            b.op("MatMul", [x, b.weight(f"w{n}{i}", (HIDDEN, width), s * std)])
            for n, width, s in (("q", HIDDEN, 3), ("k", kv_dim, 3), ("v", kv_dim, 1))
        ]
        if not flat:
            q_shape = b.op("Concat", [batch, seq, b.const([HEADS, HEAD_DIM])], axis=0)
            kv_shape = b.op("Concat", [batch, seq, kv_count, b.const([HEAD_DIM])], axis=0)
            proj = [
                b.op("Transpose", [b.op("Reshape", [p, shape], allowzero=1)], perm=[0, 2, 1, 3])
                for p, shape in zip(proj, (q_shape, kv_shape, kv_shape))
            ]
        q, k, v = proj
        past = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        present = [f"present.{i}.key", f"present.{i}.value"]
        if form == "present":
            for p, new, out in zip(past, (k, v), present):
                b.nodes.append(helper.make_node("Concat", [p, new], [out], axis=-2))
            kk, vv = present
            if repeat and kv_heads != HEADS:
                kk, vv = _repeat(b, kk, kv_heads, batch), _repeat(b, vv, kv_heads, batch)
            ins, outs, a = [q, kk, vv, mask], [f"attn{i}"], {"is_causal": 0, **attrs}
        else:
            if past_through and i == 0:
                past = [b.op(past_through, [p]) for p in past]
            ins, outs, a = [q, k, v, "", *past], [f"attn{i}", *present], {"is_causal": 1, **attrs}
            if flat:
                a.update(q_num_heads=HEADS, kv_num_heads=kv_heads)
        b.nodes.append(helper.make_node("Attention", ins, outs, name=f"attention{i}", **a))
        y = f"attn{i}"
        if not flat:
            y = b.op("Reshape", [b.op("Transpose", [y], perm=[0, 2, 1, 3]), b.const([0, 0, -1])])
        x = b.op("Add", [x, b.op("MatMul", [y, b.weight(f"wo{i}", (HIDDEN, HIDDEN), std)])])
    return b.decoder_model(
        x,
        "attention_decoder",
        layers=LAYERS,
        kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        hidden=HIDDEN,
        vocab=VOCAB,
        std=std,
        opset=23,
        ir_version=10,
    )


def _run(engine, ids, cache):
    """Logits (batch, PROMPT + STEPS, vocab): the prompt in one prefill, then one decode per token."""
    first = np.asarray(engine.prefill(ids[:, :PROMPT], cache))
    rest = [np.asarray(engine.decode(ids[:, PROMPT + j], cache)) for j in range(STEPS)]
    return np.concatenate([first, *rest], axis=1)


def _ids(batch: int) -> np.ndarray:
    return np.random.default_rng(5 + batch).integers(0, VOCAB, (batch, PROMPT + STEPS))


#: (form, kv_heads, flat, scale, repeat): the shapes every graph test runs on.
SHAPES = {
    "present-gqa-repeat": ("present", 2, False, 0.25, True),
    "present-gqa-native": ("present", 2, False, None, False),
    "present-mha": ("present", HEADS, False, 0.3, True),
    "inside-gqa-4d": ("inside", 2, False, None, True),
    "inside-mha-4d": ("inside", HEADS, False, 0.25, True),
    "inside-gqa-3d": ("inside", 2, True, 0.25, True),
    "inside-mqa-3d-default-scale": ("inside", 1, True, None, True),
}


def _model(shape: str):
    form, kv_heads, flat, scale, repeat = SHAPES[shape]
    return build_attention_decoder(form, kv_heads=kv_heads, flat=flat, scale=scale, repeat=repeat)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_operator_is_found_with_its_scale_and_layout(shape):
    form, kv_heads, flat, scale, _ = SHAPES[shape]
    sites = find_attention_sites(_model(shape))
    assert [s.layer for s in sites] == [0, 1]
    assert [s.output for s in sites] == ["attn0", "attn1"]
    want = 1 / np.sqrt(HEAD_DIM) if scale is None else float(np.float32(scale))  # the attribute is float32
    assert [s.scale for s in sites] == [want] * 2
    assert [s.flat_heads for s in sites] == [(HEADS, kv_heads) if flat else None] * 2


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rewritten_graph_gives_the_float_graphs_logits(shape, batch):
    model = _model(shape)
    rewritten, _ = rewrite_with_cache_op(model, "h")
    ops = {n.op_type for n in rewritten.graph.node}
    assert CACHE_OP in ops and not ops & {"Attention", "Range", "LessOrEqual"}  # the mask is gone too
    assert [i.name for i in rewritten.graph.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in rewritten.graph.output] == ["logits"]
    onnx.checker.check_model(rewritten)
    ids = _ids(batch)
    plain = OrtPastLoop(model)
    ref = _run(plain, ids, plain.make_cache())
    dec = OrtGraphDecoder(model)
    assert (dec.num_layers, dec.num_kv_heads, dec.head_dim) == (LAYERS, SHAPES[shape][1], HEAD_DIM)
    cache = dec.make_cache("dense")
    got = _run(dec, ids, cache)
    assert cache.seq_len(0) == cache.seq_len(1) == PROMPT + STEPS
    assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max()
    lossy = _run(dec, ids, dec.make_cache("pqo4"))
    assert 0 < np.abs(lossy - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.parametrize("shape", ["present-gqa-repeat", "inside-gqa-4d", "inside-gqa-3d"])
def test_gqa_rewrite_gives_the_float_graphs_logits(shape):
    model = _model(shape)
    ids = _ids(2)
    plain = OrtPastLoop(model)
    ref = _run(plain, ids, plain.make_cache())
    gqa = OrtPastLoop(rewrite_with_gqa(model, num_heads=HEADS, bits=None))
    assert np.abs(_run(gqa, ids, gqa.make_cache()) - ref).max() < 1e-5 * np.abs(ref).max()


def _with_scores_output(model):
    """Layer 1's Attention also returning its scores, as a graph output."""
    for node in model.graph.node:
        if node.name == "attention1":
            node.output.extend(["", "", "scores1"][len(node.output) - 1 :])
    model.graph.output.append(helper.make_tensor_value_info("scores1", F, None))
    return model


def _with_nonpad(model):
    """Layer 0's Attention given the opset-24 ``nonpad_kv_seqlen`` input."""
    model.opset_import[0].version = 24
    for node in model.graph.node:
        if node.name == "attention0":
            node.input.extend([""] * (6 - len(node.input)) + ["nonpad"])
    model.graph.input.append(helper.make_tensor_value_info("nonpad", I64, ["batch"]))
    return model


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            lambda: build_attention_decoder(attention={"softcap": 30.0}),
            "layer 0: the Attention operator 'attention0' caps its scores",
        ),
        (
            lambda: _with_scores_output(build_attention_decoder("inside")),
            "layer 1: the Attention operator 'attention1' also returns its scores",
        ),
        (lambda: _with_nonpad(build_attention_decoder()), "layer 0: .* takes nonpad_kv_seqlen"),
        (
            lambda: build_attention_decoder(attention={"is_causal": 1}),  # top-left over the whole cache
            "layer 0: .* is_causal=1 over keys already concatenated with the past",
        ),
        (
            lambda: build_attention_decoder("inside", attention={"is_causal": 0}),
            "layer 0: .* neither a mask nor is_causal=1",
        ),
        (
            lambda: build_attention_decoder("inside", past_through="Identity"),
            r"layer 0: .* takes its past from \['t\d+_Identity'",
        ),
        (
            lambda: build_attention_decoder(attention={"softmax_precision": int(TensorProto.FLOAT16)}),
            "layer 0: .* runs its softmax in element type 10",
        ),
    ],
)
def test_what_the_attention_operator_form_does_not_cover_is_refused(model, message):
    with pytest.raises(GraphRewriteError, match=message):
        rewrite_with_cache_op(model(), "h")


@pytest.mark.slow
def test_the_dynamo_exporters_graph_of_a_transformers_llama_is_rewritten():
    """torch.onnx.export(dynamo=True, opset_version=23) of a tiny random Llama with its past as inputs."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from tiny_models import HF_VOCAB, hf_llama

    llama = hf_llama(0)
    layers = llama.config.num_hidden_layers

    class WithPast(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.m.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            present = [t for layer in out.past_key_values.layers[:layers] for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    b, t, p = 2, 3, 5
    names = [f"{x}.{i}.{k}" for i in range(layers) for k in ("key", "value") for x in ("past_key_values", "present")]
    batch, seq, past_len = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    args = (
        torch.randint(0, HF_VOCAB, (b, t)),
        torch.ones(b, p + t, dtype=torch.int64),
        torch.arange(p, p + t).expand(b, t),
        *[torch.randn(b, 2, p, 16) for _ in range(2 * layers)],
    )
    dims = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: torch.export.Dim("total")},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past_len} for _ in range(2 * layers)),
    }
    program = torch.onnx.export(
        WithPast(llama).eval(),
        args,
        dynamo=True,
        opset_version=23,
        input_names=["input_ids", "attention_mask", "position_ids", *names[0::2]],
        output_names=["logits", *names[1::2]],
        dynamic_shapes=dims,
    )
    model = program.model_proto
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    assert len(attention) == layers and all(len(n.input) == 4 for n in attention)  # past outside the operator
    ids = np.random.default_rng(3).integers(0, HF_VOCAB, (1, PROMPT + STEPS))
    plain = OrtPastLoop(model)
    ref = _run(plain, ids, plain.make_cache())
    with torch.no_grad():
        eager = llama(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ref - eager).max() < 1e-4 * np.abs(eager).max()
    dec = OrtGraphDecoder(model)
    assert [s.scale for s in dec.sites] == [0.25] * layers
    assert np.abs(_run(dec, ids, dec.make_cache("dense")) - ref).max() < 1e-5 * np.abs(ref).max()
