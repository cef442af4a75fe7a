"""Export SmolLM2-135M to ONNX from its GGUF weights, then decode with a compressed KV cache.

The graph is built with ``onnx.helper`` from the float32 weights of
:func:`arraykv.integrations.decoder.gguf_loading.load_model` (no PyTorch): RMSNorm, rotate-half RoPE from
tables indexed by ``position_ids``, grouped-query attention over
``Concat(past_key_values.{i}.*, new)`` = ``present.{i}.*``, SwiGLU, tied output embedding.
It uses the standard decoder I/O names, so :class:`arraykv.integrations.onnxruntime.OrtKVDecoder`
drives it like any exported decoder.

Run::

    python examples/export_smollm2_onnx.py --methods dense pqo4 --tokens 48

It writes ``smollm2.onnx`` (+ ``smollm2.onnx.data``, ~650 MB) to the arraykv cache directory,
checks the ONNX logits against the NumPy decoder, and prints the greedy text and speed per
cache method. Needs the ``model`` and ``onnx`` extras.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def build_llama_onnx(model, *, opset: int = 17):
    """An ONNX ``ModelProto`` of a :class:`~arraykv.integrations.decoder.model.DecoderModel` (NumPy weights).

    Inputs: ``input_ids``, ``attention_mask``, ``position_ids`` (int64, ``(batch, seq)``;
    the mask is accepted and unused: attention is causal by position), and per layer
    ``past_key_values.{i}.key/value`` ``(batch, kv_heads, past, head_dim)`` float32.
    Outputs: ``logits`` ``(batch, seq, vocab)`` and ``present.{i}.key/value``.
    """
    from onnx import TensorProto, helper, numpy_helper

    c = model.config
    H, Hkv, d, F = c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_size
    g = H // Hkv
    half = d // 2
    inits, nodes = [], []
    count = [0]

    def init(name, array):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(kind, ins, n_out=1, **attrs):
        count[0] += 1
        outs = [f"{kind.lower()}_{count[0]}_{j}" for j in range(n_out)]
        nodes.append(helper.make_node(kind, ins, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def rmsnorm(x, w):
        ms = op("ReduceMean", [op("Mul", [x, x])], axes=[-1], keepdims=1)
        return op("Mul", [op("Div", [x, op("Sqrt", [op("Add", [ms, "eps"])])]), w])

    def rope(x):  # x: (b, heads, t, d)
        x1 = op("Slice", [x, "s0", "s_half", "ax3"])
        x2 = op("Slice", [x, "s_half", "s_d", "ax3"])
        a = op("Sub", [op("Mul", [x1, "cos_t"]), op("Mul", [x2, "sin_t"])])
        b = op("Add", [op("Mul", [x2, "cos_t"]), op("Mul", [x1, "sin_t"])])
        return op("Concat", [a, b], axis=-1)

    ang = np.arange(c.context_length)[:, None] * (1.0 / c.rope_theta ** (np.arange(half) * 2.0 / d))[None, :]
    init("cos", np.cos(ang).astype(np.float32))
    init("sin", np.sin(ang).astype(np.float32))
    init("eps", np.array(c.rms_eps, np.float32))
    init("scale", np.array(1.0 / np.sqrt(d), np.float32))
    init("neg", np.array(-1e9, np.float32))
    init("fzero", np.array(0.0, np.float32))
    init("s0", np.array([0], np.int64))
    init("s_half", np.array([half], np.int64))
    init("s_d", np.array([d], np.int64))
    init("ax3", np.array([3], np.int64))
    init("ax1", np.array([1], np.int64))
    init("ax_last", np.array([3], np.int64))
    init("i0", np.array(0, np.int64))
    init("i1", np.array(1, np.int64))
    init("idx2", np.array([2], np.int64))
    init("shape_q", np.array([0, 0, H, d], np.int64))
    init("shape_kv", np.array([0, 0, Hkv, d], np.int64))
    init("shape_group", np.array([0, Hkv, -1, d], np.int64))
    init("shape_heads", np.array([0, H, -1, d], np.int64))
    init("shape_merge", np.array([0, 0, H * d], np.int64))
    init("split_qkv", np.array([H * d, Hkv * d, Hkv * d], np.int64))
    init("split_gu", np.array([F, F], np.int64))
    init("tile_g", np.array([1, 1, g, 1], np.int64))
    init("emb", np.asarray(model.embedding))
    init("emb_t", np.asarray(model.embedding).T)
    init("out_norm", np.asarray(model.output_norm))

    cos_t = op("Unsqueeze", [op("Gather", ["cos", "position_ids"]), "ax1"])  # (b, 1, t, half)
    sin_t = op("Unsqueeze", [op("Gather", ["sin", "position_ids"]), "ax1"])
    nodes.append(helper.make_node("Identity", [cos_t], ["cos_t"]))
    nodes.append(helper.make_node("Identity", [sin_t], ["sin_t"]))
    # query positions per row of the grouped query layout (b, 1, g * t, 1)
    qpos = op("Tile", [op("Unsqueeze", [op("Unsqueeze", ["position_ids", "ax1"]), "ax_last"]), "tile_g"])
    x = op("Gather", ["emb", "input_ids"])
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", s])
        for n, s in (("input_ids", "seq"), ("attention_mask", "total"), ("position_ids", "seq"))
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", c.vocab_size])]
    for i, lw in enumerate(model.layers):
        p = f"blk{i}_"
        for name in ("attn_norm", "wqkv", "wo", "ffn_norm", "wgu", "wdown"):
            init(p + name, np.asarray(getattr(lw, name)))
        h = rmsnorm(x, p + "attn_norm")
        q, k, v = op("Split", [op("MatMul", [h, p + "wqkv"]), "split_qkv"], n_out=3, axis=-1)
        q = rope(op("Transpose", [op("Reshape", [q, "shape_q"])], perm=[0, 2, 1, 3]))
        k = rope(op("Transpose", [op("Reshape", [k, "shape_kv"])], perm=[0, 2, 1, 3]))
        v = op("Transpose", [op("Reshape", [v, "shape_kv"])], perm=[0, 2, 1, 3])
        kk, vv = f"present.{i}.key", f"present.{i}.value"
        nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.key", k], [kk], axis=2))
        nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.value", v], [vv], axis=2))
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, ["batch", Hkv, "past", d]
                )
            )
            outputs.append(
                helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, ["batch", Hkv, "total", d])
            )
        total = op("Squeeze", [op("Gather", [op("Shape", [kk]), "idx2"])])
        kpos = op("Range", ["i0", total, "i1"])
        bias = op("Where", [op("LessOrEqual", [kpos, qpos]), "fzero", "neg"])  # (b, 1, g*t, S)
        qg = op("Reshape", [q, "shape_group"])  # (b, Hkv, g*t, d)
        s = op("Add", [op("Mul", [op("MatMul", [qg, op("Transpose", [kk], perm=[0, 1, 3, 2])]), "scale"]), bias])
        o = op("MatMul", [op("Softmax", [s], axis=-1), vv])  # (b, Hkv, g*t, d)
        o = op("Reshape", [op("Transpose", [op("Reshape", [o, "shape_heads"])], perm=[0, 2, 1, 3]), "shape_merge"])
        x = op("Add", [x, op("MatMul", [o, p + "wo"])])
        gate, up = op("Split", [op("MatMul", [rmsnorm(x, p + "ffn_norm"), p + "wgu"]), "split_gu"], n_out=2, axis=-1)
        act = op("Mul", [op("Mul", [gate, op("Sigmoid", [gate])]), up])
        x = op("Add", [x, op("MatMul", [act, p + "wdown"])])
    nodes.append(helper.make_node("MatMul", [rmsnorm(x, "out_norm"), "emb_t"], ["logits"]))
    graph = helper.make_graph(nodes, "smollm2_decoder", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 8
    return proto


def main(argv=None) -> int:
    import onnx

    from arraykv.integrations.common.downloads import cache_dir
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.integrations.onnxruntime import OrtKVDecoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Llama .gguf file (default: SmolLM2-135M-Instruct, fetched if needed)")
    ap.add_argument("--out", default=None, help="where to write the .onnx file (default: the arraykv cache dir)")
    ap.add_argument("--methods", nargs="+", default=["dense", "pqo4"])
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)

    model = load_model(args.model)
    out = Path(args.out) if args.out else cache_dir() / "onnx" / "smollm2.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proto = build_llama_onnx(model)
    onnx.save_model(
        proto,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=out.name + ".data",
        size_threshold=1024,
    )
    onnx.checker.check_model(str(out))
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")

    dec = OrtKVDecoder(str(out))
    print(f"ONNX decoder: {dec.num_layers} layers, {dec.num_kv_heads} KV heads, head_dim {dec.head_dim}")
    ids = model.tokenizer.encode(args.prompt)
    # the graph against the NumPy decoder, prompt and one decode step
    ref_cache, ort_cache = model.make_cache("dense"), dec.make_cache("dense")
    ref = [model.prefill(ids, ref_cache)[-1], model.decode(ids[-1], ref_cache)]
    got = [dec.prefill([ids], ort_cache)[0, -1], dec.decode([ids[-1]], ort_cache)[0, -1]]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
    print(f"max |ONNX logits - NumPy logits| = {diff:.2e}")
    for method in args.methods:
        cache = dec.make_cache(method)
        t0 = time.perf_counter()
        new = dec.generate(ids, args.tokens, cache=cache, eos_id=model.tokenizer.eos_id)
        dt = time.perf_counter() - t0
        bits = cache.used_bytes() * 8 / (2 * dec.num_layers * dec.num_kv_heads * cache.seq_len(0) * dec.head_dim)
        print(f"\n[{method}] {len(new) / dt:.1f} tokens/s, {bits:.2f} bits/value")
        print(args.prompt + model.tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
