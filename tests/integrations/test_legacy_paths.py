"""The module paths of the flat layout still import, warn, and give the objects of the new layout.

Each old path (``arraykv.integrations.gguf``, ``...llama``, ...) imports with a
:class:`DeprecationWarning` naming its new module, and every public name it had is the very
object of the new module; the new paths import without a warning, and nothing in the project
imports an old path.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Old module (under ``arraykv.integrations``) to ``{new module: the old module's public names it holds}``.
OLD_PATHS = {
    "architectures": {
        "decoder.architectures": ["Architecture", "ARCHITECTURES", "architecture", "periodic_layer_types"]
    },
    "drafts": {
        "decoder.drafts": [
            "Block",
            "LayerDraft",
            "CacheDraft",
            "NgramDraft",
            "draft_from_spec",
            "run_layers",
            "RUN_MODES",
            "argmax_rows",
            "require_truncate",
        ]
    },
    "generation": {
        "common.generation": [
            "cache_length",
            "undo_on_failure",
            "check_chunk",
            "prompt_ids",
            "check_sampling",
            "generate_tokens",
            "pick_token",
            "chunked_logits",
        ]
    },
    "gguf": {
        "common.downloads": [
            "DEFAULT_PACKAGE",
            "DEFAULT_MEMBER",
            "ModelDownloadError",
            "cache_dir",
            "find_model",
            "pip_failure",
            "run_pip",
        ],
        "decoder.gguf_reader": ["read_gguf"],
        "common.optional": ["require"],
    },
    "gguf_llama": {
        "decoder.gguf_loading": [
            "load_model",
            "find_model",
            "cache_dir",
            "DecoderModel",
            "KNOWN_MODELS",
            "ModelConfig",
            "GGUFTokenizer",
            "ModelDownloadError",
            "unpermute_qk",
        ]
    },
    "gguf_write": {"decoder.gguf_writer": ["write_gguf"]},
    "llama": {"decoder.model": ["DecoderModel", "LayerWeights", "random_gguf_tensors", "unpermute_qk"]},
    "llama_attention": {
        "decoder.attention": ["plain_numpy", "rope_tables", "apply_rope", "causal_mask", "window_mask"],
        "common.layer_attention": ["attend_one", "attend_chunk", "causal_block"],
    },
    "llama_weights": {
        "decoder.weights": [
            "LAYOUT_VERSION",
            "LayerWeights",
            "layout_arrays",
            "layout_from_arrays",
            "layout_gguf_tensors",
            "random_gguf_tensors",
            "tensor_shapes",
            "unpermute_qk",
        ]
    },
    "model_config": {"decoder.model_config": ["ModelConfig"]},
    "models": {"common.downloads": ["KnownModel", "KNOWN_MODELS", "model_path", "resolve_model"]},
    "onnx_fold": {"onnxruntime.constant_fold": ["ConstantFolder"]},
    "onnx_names": {"onnxruntime.kv_names": ["PAST_NAME", "PRESENT_NAME", "discover_kv_names"]},
    "onnx_queries": {
        "onnxruntime.graph_queries": [
            "node_consumers",
            "find_query_outputs",
            "expose_outputs",
            "with_query_outputs",
            "QUERY_PASS_OPS",
        ]
    },
    "ort_cache_op": {
        "onnxruntime.cache_operator": [
            "CacheSlot",
            "register",
            "custom_op_api",
            "ensure_registered",
            "session_options",
            "attend_from_cache",
            "run_prompt",
        ]
    },
    "ort_gqa": {
        "onnxruntime.gqa_rewrite": ["rewrite_with_gqa", "calibrate_kv_scales", "OrtPastLoop", "PastState", "QMAX"]
    },
    "ort_graph": {
        "onnxruntime.graph_rewrite": [
            "AttentionSite",
            "GraphRewriteError",
            "find_attention_sites",
            "rewrite_with_cache_op",
            "replace_sites",
            "load_model_proto",
            "CACHE_OP",
            "CACHE_OP_DOMAIN",
        ]
    },
    "ort_graph_decoder": {"onnxruntime.graph_decoder": ["OrtGraphDecoder"]},
    "ort_graph_file": {
        "onnxruntime.graph_files": [
            "load_graph",
            "resolve_data",
            "write_graph",
            "rewritten_session",
            "SMALL_INITIALIZER",
        ]
    },
    "ort_store": {"onnxruntime.prefix_store": ["graph_identity", "store_prefill"]},
    "precompile": {
        "decoder.precompile": ["DEFAULT_METHODS", "Precompile", "default_methods", "kernel_key", "start", "main"]
    },
    "prompt_stage": {"common.prompt_stage": ["PromptStage", "QUERY_SAMPLE", "stages_layer", "serving_cache"]},
    "scratch_files": {"onnxruntime.scratch_files": ["owned_name", "remove_stale"]},
    "speculative": {
        "decoder.speculative": [
            "speculative_generate",
            "SpeculativeResult",
            "greedy_agreement",
            "greedy_with_gaps",
            "LayerDraft",
            "CacheDraft",
            "NgramDraft",
            "run_layers",
        ]
    },
    "tokenizer": {"decoder.tokenizer": ["GGUFTokenizer", "tokenizer_from_gguf"]},
    "torch_tensors": {"common.torch_tensors": ["float32_numpy", "to_torch"]},
    "transformers_attention": {
        "transformers.attention": [
            "FUSED_NAME",
            "Attachment",
            "attach",
            "fused_name",
            "register_fused_attention",
            "fused_attention",
            "layer_queries",
        ]
    },
    "transformers_store": {"transformers.prefix_store": ["generate_with_store", "transformers_identity"]},
    "weight_cache": {
        "decoder.weight_cache": ["FORMAT", "cache_location", "cache_file", "identity", "read", "write", "prune"]
    },
}


def _fresh_import(name: str):
    """Import ``name`` anew (as if no one had imported it in this process)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    vars(importlib.import_module(parent)).pop(child, None)
    return importlib.import_module(name)


def _new_module(new: str):
    try:
        return importlib.import_module(f"arraykv.integrations.{new}")
    except ImportError as exc:  # torch, transformers or onnx not installed
        pytest.skip(f"{new} needs an optional dependency: {exc}")


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_warns_and_gives_the_new_objects(old):
    targets = {new: _new_module(new) for new in OLD_PATHS[old]}
    with pytest.warns(DeprecationWarning, match=re.escape(f"arraykv.integrations.{next(iter(targets))}")):
        module = _fresh_import(f"arraykv.integrations.{old}")
    for new, names in OLD_PATHS[old].items():
        for name in names:
            assert getattr(module, name) is getattr(targets[new], name), f"{old}.{name} is not {new}.{name}"
    if len(targets) == 1:  # a module moved whole is the new module itself, under both names
        assert module is next(iter(targets.values()))
        assert sys.modules[f"arraykv.integrations.{old}"] is module


def test_an_old_path_warns_where_it_is_imported():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop("arraykv.integrations.model_config", None)
        vars(sys.modules["arraykv.integrations"]).pop("model_config", None)
        import arraykv.integrations.model_config  # noqa: F401 - the old path, imported by a statement here
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]


@pytest.mark.parametrize(
    "package,names",
    [("onnxruntime", {"OrtKVDecoder": "hook"}), ("transformers", {"ArraykvCache": "cache", "ArraykvLayer": "cache"})],
)
def test_the_old_engine_modules_are_packages_with_the_same_names(package, names):
    pkg = importlib.import_module(f"arraykv.integrations.{package}")
    for name, module in names.items():
        new = _new_module(f"{package}.{module}")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(pkg, name) is getattr(new, name)


def test_the_new_paths_import_without_a_warning():
    code = (
        "import sys, arraykv, arraykv.integrations.common, arraykv.integrations.decoder, "
        "arraykv.integrations.onnxruntime, arraykv.integrations.transformers\n"
        "from arraykv.integrations.decoder import DecoderModel, load_model\n"
        "from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder\n"
        "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules, 'a package import pulled them'\n"
    )
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], check=True, cwd=ROOT)


_OLD_MODULE = "|".join(OLD_PATHS)
_OLD_IMPORT = re.compile(
    rf"^\s*(?:>>>\s*)?(?:from|import)\s+(?:arraykv)?\.*integrations\.({_OLD_MODULE})\b"  # from ....gguf import x
    rf"|^\s*(?:>>>\s*)?from\s+(?:arraykv)?\.*integrations\s+import\s+[^\n]*\b({_OLD_MODULE})\b",  # ... import gguf
    re.M,
)


def test_nothing_in_the_project_imports_an_old_path():
    files = [
        *(ROOT / "arraykv").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "examples").rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
    ]
    found = []
    for path in files:
        if path.exists() and path != Path(__file__):
            for m in _OLD_IMPORT.finditer(path.read_text(encoding="utf-8")):
                found.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not found, "imports of old paths:\n" + "\n".join(found)
