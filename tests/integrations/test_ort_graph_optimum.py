"""SmolLM2-135M as Optimum exports it, with the arraykv cache inside the graph.

The export is made in an environment of its own (see ``test_onnx_optimum.py`` for the commands)
and read from the directory in ``ARRAYKV_OPTIMUM_ONNX``; the test is skipped when it is unset::

    ARRAYKV_OPTIMUM_ONNX=/tmp/smol_onnx python -m pytest -m slow tests/integrations/test_ort_graph_optimum.py

Optimum's graph writes attention as torch's ONNX export of ``scaled_dot_product_attention``
does: ``q`` and ``Kᵀ`` each multiplied by ``sqrt(1/8)``, a mask from ``attention_mask`` added,
the Softmax followed by a NaN guard. Rewritten, dense must give the float graph's logits (run
with its past fed back) and the NumPy decoder's; pqo4 must stay close to the float graph.

Measured (optimum-onnx 0.1.0, transformers 4.57.6, torch 2.13.0; 64-token prompt, 16 decode
steps): dense within 3.5e-6 of the float graph's largest logit (1.2e-4 absolute) and 2.8e-6 of
the NumPy decoder's; pqo4's mean KL against the float graph 1.9e-3 over the decode steps.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions (extra [onnx]) is not installed")

from arraykv import eval as ev  # noqa: E402
from arraykv.integrations.onnxruntime.gqa_rewrite import OrtPastLoop  # noqa: E402
from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder  # noqa: E402

from smollm import mean_kl, optimum_export_or_skip, smollm_or_skip  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT, STEPS = 64, 16


def _run(engine, ids, cache):
    """Logits (PROMPT + STEPS, vocab): the prompt in one prefill, then one decode per token."""
    first = np.asarray(engine.prefill(np.asarray(ids[:PROMPT])[None], cache)).reshape(PROMPT, -1)
    rest = [np.asarray(engine.decode([int(t)], cache)).reshape(-1) for t in ids[PROMPT : PROMPT + STEPS]]
    return np.concatenate([first, np.stack(rest)])


def test_an_optimum_export_runs_with_the_cache_inside_its_graph():
    path = optimum_export_or_skip()
    model = smollm_or_skip()
    ids = ev.builtin_token_ids(model, PROMPT + STEPS)
    plain = OrtPastLoop(str(path))
    float_graph = _run(plain, ids, plain.make_cache())
    del plain
    dec = OrtGraphDecoder(str(path))
    assert (dec.num_layers, dec.num_kv_heads, dec.head_dim) == (30, 3, 64)
    assert [i.name for i in dec.session.get_inputs()] == ["input_ids", "attention_mask", "position_ids"]
    assert [s.scale for s in dec.sites] == [0.125] * 30  # sqrt(1/8) squared, as float32 constants: 0.12499999
    cache = dec.make_cache("dense")
    dense = _run(dec, ids, cache)
    assert cache.seq_len(0) == cache.seq_len(29) == PROMPT + STEPS
    top = np.abs(float_graph).max()
    assert np.abs(dense - float_graph).max() < 1e-4 * top  # measured 3.5e-6
    numpy_decoder = _run(model, ids, model.make_cache("dense"))
    assert np.abs(dense - numpy_decoder).max() < 1e-4 * top  # measured 2.8e-6
    pqo4 = _run(dec, ids, dec.make_cache("pqo4"))
    kl = mean_kl(float_graph[PROMPT:], pqo4[PROMPT:])
    assert 0 < kl < 0.01, kl  # measured 1.9e-3
