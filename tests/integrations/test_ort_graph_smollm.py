"""SmolLM2-135M with the arraykv cache inside its ONNX graph.

Dense is the float graph, pqo4 the NumPy decoder's pqo4.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")

from arraykv import eval as ev  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402

from smollm import mean_kl, smollm_or_skip  # noqa: E402
from tiny_models import llama_onnx  # noqa: E402

pytestmark = pytest.mark.slow


def test_smollm2_graph_with_the_cache_inside_matches_the_numpy_decoder():
    model = smollm_or_skip()
    dec = OrtGraphDecoder(llama_onnx(model))
    assert (dec.num_layers, dec.num_kv_heads, dec.head_dim) == (30, 3, 64)
    assert not any(i.name.startswith("past_key_values") for i in dec.session.get_inputs())
    ids = ev.builtin_token_ids(model, 160)
    exact = ev.teacher_forced(model, ids, prefill=64).logits
    dense = ev.teacher_forced(dec, ids, dec.make_cache("dense"), prefill=64).logits
    assert np.abs(dense - exact).max() < 5e-4
    ref = ev.teacher_forced(model, ids, model.make_cache("pqo4"), prefill=64).logits
    got = ev.teacher_forced(dec, ids, dec.make_cache("pqo4"), prefill=64).logits
    kl_same, kl_lossy = mean_kl(ref, got), mean_kl(exact, ref)
    assert kl_lossy > 1e-4  # pqo4 changes the model's outputs measurably ...
    assert kl_same < 0.1 * kl_lossy  # ... and the graph's pqo4 changes them as the decoder's does
