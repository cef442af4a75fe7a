"""Seeded random numbers drawn on the host and moved into any array namespace.

The array API has no random module, so algorithms that need reproducible randomness
(k-means++ seeding) draw from a NumPy generator here and convert with ``xp.asarray``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["host_uniform"]


def host_uniform(xp: Any, shape: tuple, *, seed: int, device: Any = None):
    """Uniform float32 numbers in ``[0, 1)`` of ``shape`` from ``numpy.random.default_rng(seed)``.

    The same ``seed`` gives the same numbers on every namespace and device.
    """
    u = np.random.default_rng(seed).random(shape, dtype=np.float64).astype(np.float32)
    return xp.asarray(u, device=device)
