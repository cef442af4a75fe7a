"""Where bytes live: growable per-layer buffers, a paged block pool, MLA latents."""

from .growable import TokenBuffers

__all__ = ["TokenBuffers"]
