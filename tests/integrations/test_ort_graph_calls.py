"""The per-call path of the ``ArrayKVAttention`` operator: what ONNX Runtime's call of a node does.

A decode step calls the operator once per layer; what each call does beyond the cache's own work
is overhead of every step. These tests pin down the work removed from it (measured in
``docs/onnxruntime.md``): the answer handed to ONNX Runtime as an array rather than a Python
list, attributes parsed once per node, the decode configuration checked once per geometry.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")


from arraykv import protocol  # noqa: E402
from arraykv.integrations.onnxruntime.cache_operator import custom_op_api  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402

from tiny_models import ONNX_LLAMA as CFG, decoder, llama_onnx  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return decoder(CFG, seed=3)


@pytest.fixture(scope="module")
def dec(model):
    return OrtGraphDecoder(llama_onnx(model))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(5).integers(0, CFG.vocab_size, 40)


def test_node_calls_skip_the_extension_packages_conversions(model, dec, ids, monkeypatch):
    """The package's own invoker converts a node's attributes (``cast_attributes``) and its answer
    (a Python list) on every call; the operator's calls go around both and give the same logits."""
    ox = custom_op_api()
    converted = []
    real = ox.Opdef.cast_attributes

    def counting(self, attributes):
        converted.append(self.op_type)
        return real(self, attributes)

    monkeypatch.setattr(ox.Opdef, "cast_attributes", counting)
    cache = dec.make_cache("pqo4")
    got = [dec.prefill(ids[:24], cache)[0, -1]] + [dec.decode(int(t), cache)[0, 0] for t in ids[24:30]]
    assert converted == []
    own_cache = model.make_cache("pqo4")
    want = [model.prefill(ids[:24], own_cache)[-1]] + [model.decode(int(t), own_cache) for t in ids[24:30]]
    assert max(np.abs(a - b).max() for a, b in zip(got, want)) < 1e-3


_NEGATE = """
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from arraykv.integrations.onnxruntime.cache_operator import custom_op_api, session_options

ox = custom_op_api()
session_options()  # the ArrayKVAttention operator and its invoker are registered first
f = ox.PyCustomOpDef.dt_float
ox.Opdef.declare(op_type="ArraykvTestNegate", inputs=[f], outputs=[f])(lambda x: -x)
node = helper.make_node("ArraykvTestNegate", ["x"], ["y"], domain="ai.onnx.contrib")
io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "y")]
graph = helper.make_graph([node], "negate", io[:1], io[1:])
opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)]
model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
x = np.arange(6, dtype=np.float32).reshape(2, 3)
assert (sess.run(None, {"x": x})[0] == -x).all()
print("ok")
"""


def test_other_python_operators_still_run_through_the_packages_invoker():
    """The invoker replaces the package's for the ``ArrayKVAttention`` operator only. (In a
    process of its own: declaring an operator moves the package's table of operators, which
    sessions opened before hold pointers into.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NEGATE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_decode_steps_check_their_configuration_once(dec, ids, monkeypatch):
    """``AttendConfig`` validates its fields when made; a node's configuration is made once."""
    cache = dec.make_cache("pqo4")
    dec.prefill(ids[:24], cache)
    dec.decode(int(ids[24]), cache)  # the first step of this geometry may make it
    made = []
    real = protocol.AttendConfig.__post_init__

    def counting(self):
        made.append(self)
        real(self)

    monkeypatch.setattr(protocol.AttendConfig, "__post_init__", counting)
    for t in ids[25:29]:
        dec.decode(int(t), cache)
    assert made == []
