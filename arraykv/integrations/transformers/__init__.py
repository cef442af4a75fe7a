"""The Hugging Face transformers engine: an arraykv cache as a ``transformers`` ``Cache``.

=====================  ==========================================================================
module                 holds
=====================  ==========================================================================
``cache``              :class:`ArraykvCache` and :class:`ArraykvLayer`
``attention``          the fused attention function registered with transformers
``prefix_store``       :func:`generate_with_store`: prefill states shared through a prefix store
=====================  ==========================================================================

``from arraykv.integrations.transformers import ArraykvCache`` imports torch and transformers;
importing this package alone does not.
"""

from ..common.optional import lazy_exports

_EXPORTS = {
    "ArraykvCache": "cache",
    "ArraykvLayer": "cache",
    "generate_with_store": "prefix_store",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
