"""The own decoder: Llama, Qwen 2/3 and Gemma 3 GGUF models computed with NumPy (or CuPy).

=====================  ==========================================================================
module                 holds
=====================  ==========================================================================
``gguf_loading``       :func:`load_model`: a GGUF file (or a known model's name) to a model
``gguf_reader``        :func:`read_gguf`: a GGUF file's config and float32 tensors
``gguf_writer``        :func:`write_gguf`: the inverse, for tests and small made-up models
``model``              :class:`DecoderModel`: the decode and prefill steps over a cache
``weights``            the layer weights, their layout and random ones of a config
``attention``          RoPE tables and the prefill masks
``architectures``      what differs between Llama, Qwen 2/3 and Gemma 3
``model_config``       :class:`ModelConfig`: the hyper-parameters
``tokenizer``          :class:`GGUFTokenizer`: the tokenizer stored in the file
``speculative``        :func:`speculative_generate`: a draft proposes, the model verifies
``drafts``             the drafts (layers of the model, another cache, n-grams)
``precompile``         the kernels of a model's geometry, compiled in a child process
``weight_cache``       laid-out weights kept on disk between loads
=====================  ==========================================================================
"""

from ..common.optional import lazy_exports

_EXPORTS = {
    "load_model": "gguf_loading",
    "read_gguf": "gguf_reader",
    "write_gguf": "gguf_writer",
    "DecoderModel": "model",
    "ModelConfig": "model_config",
    "ARCHITECTURES": "architectures",
    "GGUFTokenizer": "tokenizer",
    "tokenizer_from_gguf": "tokenizer",
    "random_gguf_tensors": "weights",
    "speculative_generate": "speculative",
    "SpeculativeResult": "speculative",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
