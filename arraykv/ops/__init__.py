"""Accelerated ops: one entry per op, a kernel for the namespace or the array-API reference.

Each op takes exactly the arguments of its reference in :mod:`arraykv.quant` or
:mod:`arraykv.attention` and returns what it returns; on NumPy arrays it runs a Numba kernel
(:mod:`arraykv.ops.numba`), on CuPy arrays a CUDA kernel (:mod:`arraykv.ops.cuda`), elsewhere
(or with kernels turned off, or the accelerator not installed) the reference. One registry
(:mod:`arraykv.ops.registry`) names them all. Nothing here imports Numba or CuPy until a
kernel is first used.
"""

from .codecs import (
    INTQ_KERNEL_BITS,
    intq_dequantize,
    intq_group_minmax,
    intq_quantize_pack,
    pack_bits,
    polar_decode,
    polar_encode,
    polar_encode_tokens,
    polar_store_token,
    split_outliers,
    unpack_bits,
    vq_assign,
    vq_decode,
    vq_encode,
    vq_update,
)
from .fused import (
    INT_KERNEL_BITS,
    has_kernel,
    int_decode_attention,
    lowrank_decode_attention,
    polar_decode_attention,
    vq_decode_attention,
)
from .kernel_files import kernel_names, kernel_source
from .registry import implementation, kernels_enabled, lookup, op_names, reference, register_op, set_kernels_enabled

__all__ = [
    "pack_bits",
    "unpack_bits",
    "polar_encode",
    "polar_encode_tokens",
    "polar_store_token",
    "polar_decode",
    "intq_group_minmax",
    "intq_quantize_pack",
    "intq_dequantize",
    "split_outliers",
    "vq_assign",
    "vq_update",
    "vq_encode",
    "vq_decode",
    "polar_decode_attention",
    "int_decode_attention",
    "vq_decode_attention",
    "lowrank_decode_attention",
    "has_kernel",
    "lookup",
    "reference",
    "implementation",
    "op_names",
    "register_op",
    "kernels_enabled",
    "set_kernels_enabled",
    "kernel_names",
    "kernel_source",
    "INTQ_KERNEL_BITS",
    "INT_KERNEL_BITS",
]
