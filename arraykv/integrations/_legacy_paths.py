"""The module paths of the flat layout (``arraykv.integrations.gguf``, ...), kept for one release.

Importing an old path warns (:class:`DeprecationWarning`, naming the new path) and gives the
module of the new layout itself, registered under the old name too; the two old modules whose
contents were split (``gguf``, ``llama_attention``) give a module of their old public names,
each the object of the new layout. :func:`install` puts the finder at the end of
:data:`sys.meta_path` once, so a real module of the package is always found first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "SPLIT", "install"]

_PREFIX = "arraykv.integrations."

#: Old module name to its new module (under ``arraykv.integrations``).
MOVED = {
    "architectures": "decoder.architectures",
    "drafts": "decoder.drafts",
    "gguf_llama": "decoder.gguf_loading",
    "gguf_write": "decoder.gguf_writer",
    "llama": "decoder.model",
    "llama_weights": "decoder.weights",
    "model_config": "decoder.model_config",
    "precompile": "decoder.precompile",
    "speculative": "decoder.speculative",
    "tokenizer": "decoder.tokenizer",
    "weight_cache": "decoder.weight_cache",
    "generation": "common.generation",
    "models": "common.downloads",
    "prompt_stage": "common.prompt_stage",
    "torch_tensors": "common.torch_tensors",
    "onnx_fold": "onnxruntime.constant_fold",
    "onnx_names": "onnxruntime.kv_names",
    "onnx_queries": "onnxruntime.graph_queries",
    "ort_cache_op": "onnxruntime.cache_operator",
    "ort_gqa": "onnxruntime.gqa_rewrite",
    "ort_graph": "onnxruntime.graph_rewrite",
    "ort_graph_decoder": "onnxruntime.graph_decoder",
    "ort_graph_file": "onnxruntime.graph_files",
    "ort_store": "onnxruntime.prefix_store",
    "scratch_files": "onnxruntime.scratch_files",
    "transformers_attention": "transformers.attention",
    "transformers_store": "transformers.prefix_store",
}

#: Old modules split over several new ones: old name to ``{new module: [its old public names]}``.
SPLIT = {
    "gguf": {
        "decoder.gguf_reader": ["read_gguf"],
        "common.downloads": [
            "DEFAULT_PACKAGE",
            "DEFAULT_MEMBER",
            "ModelDownloadError",
            "cache_dir",
            "find_model",
            "pip_failure",
            "run_pip",
        ],
        "common.optional": ["require"],
    },
    "llama_attention": {
        "decoder.attention": ["plain_numpy", "rope_tables", "apply_rope", "causal_mask", "window_mask"],
        "common.layer_attention": ["attend_one", "attend_chunk", "causal_block"],
    },
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads it as its module of the new layout."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec loaded by this finder for an old path, else None."""
        old = fullname[len(_PREFIX) :] if fullname.startswith(_PREFIX) else ""
        if old not in MOVED and old not in SPLIT:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """The default module (a split module's names go into it)."""
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        """Warn, then put the new module under the old name (or the old names into ``module``)."""
        old = module.__name__[len(_PREFIX) :]
        parts = SPLIT[old] if old in SPLIT else {MOVED[old]: []}
        new = [_PREFIX + name for name in parts]
        warnings.warn(
            f"{module.__name__} is deprecated and will be removed in a later release; "
            f"import from {' or '.join(new)} instead",
            DeprecationWarning,
            stacklevel=2,
        )
        if old in MOVED:
            sys.modules[module.__name__] = importlib.import_module(new[0])
            return
        names: list = []
        for name, source in zip(new, parts.values()):
            mod = importlib.import_module(name)
            for attr in source:
                setattr(module, attr, getattr(mod, attr))
            names.extend(source)
        setattr(module, "__all__", names)  # noqa: B010 - a module type has no __all__ slot to type
        module.__doc__ = f"The old path of {', '.join(new)} (deprecated)."


def install() -> None:
    """Append the finder of the old paths to :data:`sys.meta_path`, unless it is there already."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
