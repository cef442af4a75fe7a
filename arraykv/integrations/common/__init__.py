"""What every engine shares; imports no engine subpackage.

=====================  ==========================================================================
module                 holds
=====================  ==========================================================================
``optional``           :func:`require` (an optional dependency, or which extra installs it) and
                       the lazy re-exports of the packages
``downloads``          where model files come from: known models by name, the default GGUF file
``generation``         one generation convention for every engine (prompt ids, sampling, chunks)
``prompt_stage``       the exact staging of a prompt's keys and values before a cache takes them
``layer_attention``    :func:`attend_one` / :func:`attend_chunk`, one layer's attention call
``torch_tensors``      torch tensors to and from NumPy arrays (imports torch)
=====================  ==========================================================================
"""

from .optional import lazy_exports

_EXPORTS = {
    "require": "optional",
    "DEFAULT_PACKAGE": "downloads",
    "DEFAULT_MEMBER": "downloads",
    "KnownModel": "downloads",
    "KNOWN_MODELS": "downloads",
    "ModelDownloadError": "downloads",
    "cache_dir": "downloads",
    "find_model": "downloads",
    "model_path": "downloads",
    "resolve_model": "downloads",
    "PromptStage": "prompt_stage",
    "attend_chunk": "layer_attention",
    "attend_one": "layer_attention",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
