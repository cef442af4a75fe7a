"""Bridges to inference code, one subpackage per engine.

=====================  ==========================================================================
subpackage             engine
=====================  ==========================================================================
``decoder``            the own NumPy/CuPy decoder of GGUF models (Llama, Qwen 2/3, Gemma 3):
                       :func:`~arraykv.integrations.decoder.load_model`,
                       :class:`~arraykv.integrations.decoder.DecoderModel`
``onnxruntime``        ONNX Runtime decoders with an arraykv cache:
                       :class:`~arraykv.integrations.onnxruntime.OrtKVDecoder`,
                       :class:`~arraykv.integrations.onnxruntime.OrtGraphDecoder`
``transformers``       Hugging Face transformers:
                       :class:`~arraykv.integrations.transformers.ArraykvCache`
``common``             what every engine shares (model downloads, the generation convention,
                       prompt staging, one layer's attention); imports no engine
=====================  ==========================================================================

The engines never import one another. The module paths of the earlier flat layout
(``arraykv.integrations.gguf``, ``arraykv.integrations.llama``, ...) still import, with a
:class:`DeprecationWarning` naming the new path (:mod:`arraykv.integrations._legacy_paths`).
"""

from ._legacy_paths import install as _install_legacy_paths

_install_legacy_paths()
