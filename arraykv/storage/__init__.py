"""Where bytes live: growable per-layer buffers, a paged block pool, MLA latents."""

from .growable import TokenBuffers
from .mla import MlaCache
from .paged import PagedKVCache

__all__ = ["TokenBuffers", "PagedKVCache", "MlaCache"]
