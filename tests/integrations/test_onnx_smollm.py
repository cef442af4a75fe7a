"""SmolLM2-135M as an ONNX graph under the hook: the graph's queries make its pqo4 the NumPy decoder's pqo4."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")

from arraykv import eval as ev  # noqa: E402
from arraykv.integrations.onnxruntime import OrtKVDecoder  # noqa: E402

from smollm import mean_kl, smollm_or_skip  # noqa: E402
from tiny_models import llama_onnx  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines():
    model = smollm_or_skip()
    graph = llama_onnx(model).SerializeToString()
    return model, graph


def test_graph_queries_make_ort_pqo4_the_decoders_pqo4(engines):
    """Measured on 512 tokens: KL(NumPy pqo4 || ORT pqo4) 2.5e-4 with the graph's queries,
    4.9e-3 with zero queries (key channel weights of 1); here 256 tokens."""
    model, graph = engines
    ids = ev.builtin_token_ids(model, 256)
    ref = ev.teacher_forced(model, ids, model.make_cache("pqo4")).logits
    with_q = OrtKVDecoder(graph)
    assert with_q.query_outputs is not None and len(with_q.query_outputs) == model.config.num_layers
    got = ev.teacher_forced(with_q, ids, with_q.make_cache("pqo4")).logits
    without = OrtKVDecoder(graph, queries=False)
    off = ev.teacher_forced(without, ids, without.make_cache("pqo4")).logits
    kl_on, kl_off = mean_kl(ref, got), mean_kl(ref, off)
    assert kl_on < 1e-3, kl_on
    assert kl_off > 3 * kl_on, (kl_on, kl_off)
