"""The same decoder graph with ONNX Runtime's own quantized KV cache (``GroupQueryAttention``).

ONNX Runtime's contrib operator ``com.microsoft.GroupQueryAttention`` keeps the past K/V
itself and can hold it as 8-bit (``int8``) or 4-bit (two codes per ``uint8``) integers
(attribute ``kv_cache_bit_width``), with scales given as inputs ``k_scale``/``v_scale`` —
fixed tensors, not computed from the data: per channel, ``(1, kv_heads, 1, head_dim)``
(``k_quant_type = v_quant_type = "PER_CHANNEL"``). A value ``x`` is stored as
``clip(round(x / scale), -8, 7)`` (4 bits, plus 8 in the nibble) or ``clip(round(x / scale),
-128, 127)`` (8 bits); measured on the CPU execution provider of onnxruntime 1.32, which runs
both widths.

- :func:`calibrate_kv_scales` derives those scales from the float graph's K/V on a calibration
  text (per channel ``max |x| / 7`` or ``/ 127``): ONNX Runtime leaves choosing them to the
  user, so this is one reasonable choice, not ONNX Runtime's.
- :func:`rewrite_with_gqa` replaces each layer's attention over the past (found by
  :func:`arraykv.integrations.onnxruntime.graph_rewrite.find_attention_sites`) with a ``GroupQueryAttention``
  node (rotary embedding already applied by the graph, ``do_rotary = 0``): the past inputs and
  present outputs stay, with the quantized element type.
- :class:`OrtPastLoop` is the plain ONNX Runtime loop over such a graph (each step's
  ``present.*`` fed back as the next ``past_key_values.*``), with the ``prefill``/``decode``/
  ``make_cache`` convention of the other engines so the evaluation code can drive it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..common.optional import require
from .graph_rewrite import AttentionSite, find_attention_sites, load_model_proto, replace_sites

__all__ = ["rewrite_with_gqa", "calibrate_kv_scales", "OrtPastLoop", "PastState", "QMAX"]

#: Largest code magnitude per bit width (the scale maps ``max |x|`` to it).
QMAX = {4: 7.0, 8: 127.0}


def calibrate_kv_scales(model: Any, token_ids: Sequence[int], bits: int) -> list:
    """Per-layer ``(k_scale, v_scale)`` for :func:`rewrite_with_gqa`, from the float graph's K/V.

    Parameters
    ----------
    model : str, PathLike, bytes or onnx.ModelProto
        The float decoder with ``past_key_values.*`` inputs and ``present.*`` outputs.
    token_ids : sequence of int
        The calibration text, run once as a prompt.
    bits : {4, 8}

    Returns
    -------
    list of (numpy.ndarray, numpy.ndarray)
        Per layer, float32 ``(1, kv_heads, 1, head_dim)``: ``max |x|`` over the text's tokens,
        per head and channel, divided by :data:`QMAX` ``[bits]`` (a channel that is all zero
        gets scale 1).
    """
    import numpy as np

    if bits not in QMAX:
        raise ValueError(f"bits must be 4 or 8, received {bits!r}")
    loop = OrtPastLoop(model)  # a file opened by its path: its weights are not copied through Python
    state = loop.make_cache()
    ids = np.asarray(token_ids, dtype=np.int64)[None, :]
    outs = loop.run(ids, state, all_outputs=True)
    scales = []
    for i in range(loop.num_layers):
        pair = []
        for kind in ("key", "value"):
            a = np.abs(outs[f"present.{i}.{kind}"]).max(axis=(0, 2), keepdims=True)
            pair.append(np.where(a > 0, a / QMAX[bits], 1.0).astype(np.float32))
        scales.append(tuple(pair))
    return scales


def rewrite_with_gqa(model: Any, *, num_heads: int, bits: int | None, scales: list | None = None) -> Any:
    """``model`` with each layer's attention over the past computed by ``GroupQueryAttention``.

    Parameters
    ----------
    model : onnx.ModelProto
        A float32 decoder with ``past_key_values.{i}.*`` inputs, ``present.{i}.*`` outputs and an
        ``attention_mask`` input (ones over past and new tokens).
    num_heads : int
        Query heads.
    bits : {4, 8} or None
        Width of the quantized cache; None keeps it float32 (the operator's float path).
    scales : list of (k_scale, v_scale), optional
        Per layer, float32 ``(1, kv_heads, 1, head_dim)`` (:func:`calibrate_kv_scales`);
        required when ``bits`` is given.

    Returns
    -------
    onnx.ModelProto
        ``past_key_values.{i}.*`` / ``present.{i}.*`` of shape ``(batch, kv_heads, tokens,
        head_dim)`` int8 (8 bits), ``(batch, kv_heads, tokens, head_dim / 2)`` uint8 (4 bits)
        or float32.
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be 4, 8 or None, received {bits!r}")
    sites = find_attention_sites(model)
    if bits is not None and (scales is None or len(scales) != len(sites)):
        raise ValueError(
            f"bits={bits} needs one (k_scale, v_scale) pair per layer ({len(sites)}), "
            f"received {None if scales is None else len(scales)}"
        )
    g = model.graph
    if "attention_mask" not in {vi.name for vi in g.input}:
        raise ValueError("GroupQueryAttention needs the sequence lengths; the graph has no attention_mask input")
    past = next(vi for vi in g.input if vi.name == "past_key_values.0.key")
    dims = [d.dim_value for d in past.type.tensor_type.shape.dim]
    hkv, d = dims[1], dims[3]
    if not (hkv > 0 and d > 0):
        raise ValueError("the past inputs must declare kv_heads and head_dim as numbers")
    if num_heads % hkv:
        raise ValueError(f"num_heads={num_heads} is not a multiple of the {hkv} KV heads")
    inits = [
        numpy_helper.from_array(np.array([0, 0, num_heads * d], np.int64), "gqa_q3"),
        numpy_helper.from_array(np.array([0, 0, hkv * d], np.int64), "gqa_kv3"),
        numpy_helper.from_array(np.array([0, num_heads, -1, d], np.int64), "gqa_q4"),
        numpy_helper.from_array(np.array([0, 0, num_heads, d], np.int64), "gqa_o4"),
        numpy_helper.from_array(np.array([1], np.int64), "gqa_axis1"),
        numpy_helper.from_array(np.array(1, np.int64), "gqa_one"),
    ]
    shared = [  # seqlens_k = (sum of the mask) - 1, total_sequence_length = its width, int32
        helper.make_node("ReduceSum", ["attention_mask", "gqa_axis1"], ["gqa_mask_sum"], keepdims=0),
        helper.make_node("Sub", ["gqa_mask_sum", "gqa_one"], ["gqa_seqlens64"]),
        helper.make_node("Cast", ["gqa_seqlens64"], ["gqa_seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["gqa_mask_shape"], start=1, end=2),
        helper.make_node("Squeeze", ["gqa_mask_shape"], ["gqa_total64"]),
        helper.make_node("Cast", ["gqa_total64"], ["gqa_total"], to=TensorProto.INT32),
    ]
    attrs: dict = {}
    if bits is not None and scales is not None:  # (bits without scales was refused above)
        attrs = dict(kv_cache_bit_width=bits, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
        for i, (ks, vs) in enumerate(scales):
            for name, s in ((f"gqa_k_scale_{i}", ks), (f"gqa_v_scale_{i}", vs)):
                s = np.asarray(s, np.float32)
                if s.shape != (1, hkv, 1, d):
                    raise ValueError(f"scales[{i}] must have shape (1, {hkv}, 1, {d}), received {s.shape}")
                inits.append(numpy_helper.from_array(s, name))

    def make(site: AttentionSite) -> list:
        i, p = site.layer, f"gqa{site.layer}_"
        nodes = shared if i == 0 else []
        nodes = list(nodes) + [
            helper.make_node("Reshape", [site.query, "gqa_q4"], [p + "q4"]),
            helper.make_node("Transpose", [p + "q4"], [p + "qt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [p + "qt", "gqa_q3"], [p + "q3"]),
            helper.make_node("Transpose", [site.new_key], [p + "kt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [p + "kt", "gqa_kv3"], [p + "k3"]),
            helper.make_node("Transpose", [site.new_value], [p + "vt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [p + "vt", "gqa_kv3"], [p + "v3"]),
        ]
        ins = [
            p + "q3",
            p + "k3",
            p + "v3",
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            "gqa_seqlens_k",
            "gqa_total",
        ]
        if bits is not None:
            ins += ["", "", "", "", "", f"gqa_k_scale_{i}", f"gqa_v_scale_{i}"]
        nodes += [
            helper.make_node(
                "GroupQueryAttention",
                ins,
                [p + "o3", f"present.{i}.key", f"present.{i}.value"],
                name=f"gqa_{i}",
                domain="com.microsoft",
                num_heads=num_heads,
                kv_num_heads=hkv,
                scale=site.scale,
                **attrs,
            ),
            helper.make_node("Reshape", [p + "o3", "gqa_o4"], [p + "o4"]),
            helper.make_node("Transpose", [p + "o4"], [p + "ot"], perm=[0, 2, 1, 3]),
            helper.make_node("Shape", [site.query], [p + "qshape"]),
            helper.make_node("Reshape", [p + "ot", p + "qshape"], [site.output]),
        ]
        return nodes

    src = type(model)()
    src.CopyFrom(model)
    src.graph.initializer.extend(inits)
    out = replace_sites(src, sites, make, keep_kv_io=True, domains={"com.microsoft": 1})
    elem = {None: TensorProto.FLOAT, 8: TensorProto.INT8, 4: TensorProto.UINT8}[bits]
    width = d // 2 if bits == 4 else d
    for vi in list(out.graph.input) + list(out.graph.output):
        if vi.name.startswith(("past_key_values.", "present.")):
            vi.type.tensor_type.elem_type = elem
            vi.type.tensor_type.shape.dim[3].dim_value = width
    return out


class PastState:
    """The past K/V an :class:`OrtPastLoop` feeds back: ONNX Runtime's own cache, held between steps.

    Attributes
    ----------
    past : list of (numpy.ndarray, numpy.ndarray) or None
        Per layer, the last ``present.{i}.key/value`` (their dtype: float32, int8 or packed uint8).
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.past: list | None = None

    def seq_len(self, layer: int) -> int:
        """Tokens held in ``layer``."""
        return 0 if self.past is None else int(self.past[layer][0].shape[2])

    def reset(self) -> None:
        self.past = None

    def memory_usage(self) -> int:
        """Bytes of the past arrays held (scales, being graph constants, are not counted)."""
        return 0 if self.past is None else sum(int(k.nbytes) + int(v.nbytes) for k, v in self.past)


class OrtPastLoop:
    """The plain ONNX Runtime decode loop: ``present.*`` fed back as ``past_key_values.*``.

    Parameters
    ----------
    model : str, PathLike, bytes, onnx.ModelProto or onnxruntime.InferenceSession
        A decoder with ``past_key_values.{i}.*`` inputs of any element type.
    providers : list of str, optional

    Attributes
    ----------
    num_layers : int
    session : onnxruntime.InferenceSession
    """

    def __init__(self, model: Any, *, providers: Sequence[str] | None = None):
        ort = require("onnxruntime", "onnx")
        if isinstance(model, ort.InferenceSession):
            sess = model
        elif isinstance(model, (str, os.PathLike)):
            sess = ort.InferenceSession(str(model), providers=list(providers or ["CPUExecutionProvider"]))
        else:
            proto = load_model_proto(model)
            sess = ort.InferenceSession(
                proto.SerializeToString(), providers=list(providers or ["CPUExecutionProvider"])
            )
        self.session = sess
        self._inputs = {i.name: i for i in sess.get_inputs()}
        self.num_layers = sum(1 for n in self._inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        if self.num_layers == 0:
            raise ValueError("the model has no past_key_values.{i}.key inputs")
        self._outputs = [o.name for o in sess.get_outputs()]
        self.logits_name = "logits" if "logits" in self._outputs else self._outputs[0]
        types = {
            "tensor(float)": "float32",
            "tensor(int8)": "int8",
            "tensor(uint8)": "uint8",
            "tensor(float16)": "float16",
        }
        past = self._inputs["past_key_values.0.key"]
        self._past_dtype = types[past.type]
        self._past_shape = [s if isinstance(s, int) else None for s in past.shape]

    def make_cache(self, method: Any = None) -> PastState:
        """An empty :class:`PastState` (``method`` is ignored: the graph fixes how the past is held)."""
        return PastState(self.num_layers)

    def run(self, ids: Any, state: PastState, *, all_outputs: bool = False) -> Any:
        """One step on ``ids`` (batch, t); returns logits, or every output by name with ``all_outputs``."""
        import numpy as np

        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        b, t = ids.shape
        past_len = state.seq_len(0)
        feeds = {"input_ids": ids}
        if "attention_mask" in self._inputs:
            feeds["attention_mask"] = np.ones((b, past_len + t), np.int64)
        if "position_ids" in self._inputs:
            feeds["position_ids"] = np.broadcast_to(np.arange(past_len, past_len + t, dtype=np.int64), (b, t)).copy()
        for i in range(self.num_layers):
            for j, kind in enumerate(("key", "value")):
                if state.past is None:
                    shape = (b, self._past_shape[1], 0, self._past_shape[3])
                    feeds[f"past_key_values.{i}.{kind}"] = np.zeros(shape, self._past_dtype)
                else:
                    feeds[f"past_key_values.{i}.{kind}"] = state.past[i][j]
        res = dict(zip(self._outputs, self.session.run(self._outputs, feeds)))
        state.past = [(res[f"present.{i}.key"], res[f"present.{i}.value"]) for i in range(self.num_layers)]
        return res if all_outputs else res[self.logits_name]

    def prefill(self, input_ids: Any, state: PastState) -> Any:
        """Tokens (batch, t) after what ``state`` holds; logits (batch, t, vocab)."""
        return self.run(input_ids, state)

    def decode(self, input_ids: Any, state: PastState) -> Any:
        """One token per sequence; logits (batch, 1, vocab)."""
        import numpy as np

        return self.run(np.asarray(input_ids).reshape(-1, 1), state)
