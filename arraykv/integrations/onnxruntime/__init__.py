"""The ONNX Runtime engine: a decoder graph whose KV cache arraykv holds.

Two ways: :class:`OrtKVDecoder` (``hook``) feeds the graph's past inputs from an arraykv cache
each step; :class:`OrtGraphDecoder` (``graph_decoder``) rewrites the graph so that a custom
operator (``cache_operator``) attends over the cache inside it.

=====================  ==========================================================================
module                 holds
=====================  ==========================================================================
``hook``               :class:`OrtKVDecoder`
``graph_decoder``      :class:`OrtGraphDecoder`
``cache_operator``     the custom operator that reads and appends the cache in the graph
``graph_rewrite``      finding the attention sites of a graph and replacing them by the operator
``gqa_rewrite``        the rewrite to ONNX Runtime's ``GroupQueryAttention`` (a baseline)
``graph_files``        rewritten graphs written beside their data files, and their sessions
``scratch_files``      names of scratch files a process owns, and removing stale ones
``constant_fold``      folding constant subgraphs before matching them
``graph_queries``      exposing a graph's attention queries as outputs
``kv_names``           the past and present names of a graph's KV inputs and outputs
``prefix_store``       prefill states shared through a prefix store
=====================  ==========================================================================

Inside this package ``import onnxruntime`` (absolute) is the ONNX Runtime package itself.
"""

from ..common.optional import lazy_exports

_EXPORTS = {
    "OrtKVDecoder": "hook",
    "OrtGraphDecoder": "graph_decoder",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
