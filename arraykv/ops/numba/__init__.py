"""Numba kernels for NumPy arrays (imported only when an op first asks for one).

Each kernel module raises ImportError when Numba is missing. Modules: ``threads`` (the one
threading policy), ``bitpack``, ``polar``, ``intq``, ``outliers``, ``vq`` (one-pass kernels),
``fused_driver`` (the decode-attention step shared by the fused kernels), ``polar_fused``,
``int_fused``, ``vq_fused`` (their per-tile scoring and accumulation).
"""
