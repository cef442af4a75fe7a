"""Torch tensors to the float32 NumPy arrays a cache takes, and its arrays back to tensors.

Shared by the transformers bridge (:mod:`arraykv.integrations.transformers`) and its attention
hooks (:mod:`arraykv.integrations.transformers.attention`); both need torch, which arraykv does
not install.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["float32_numpy", "to_torch"]


def float32_numpy(t: Any) -> Any:
    """A CPU tensor as a float32 NumPy array: shares memory when it is float32 already.

    Parameters
    ----------
    t : torch.Tensor
        On the CPU, of any floating dtype; gradients are not followed (``detach``).

    Returns
    -------
    numpy.ndarray
        float32, of ``t``'s shape.
    """
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.numpy()


def to_torch(a: Any, dtype: Any) -> Any:
    """A NumPy array as a torch tensor of ``dtype`` (no copy for float32 when the array is writable).

    Parameters
    ----------
    a : numpy.ndarray
    dtype : torch.dtype

    Returns
    -------
    torch.Tensor
        On the CPU, of ``a``'s shape; a read-only ``a`` is copied first (torch cannot share it).
    """
    if not a.flags.writeable:
        a = np.array(a)
    t = torch.from_numpy(a)
    return t if t.dtype == dtype else t.to(dtype)
