"""Numba kernels for NumPy arrays (imported only when an op first asks for one).

Each kernel module raises ImportError when Numba is missing. Modules:

* ``threads``: the one threading policy;
* ``bitpack``, ``intq``, ``outliers``, ``vq``: one-pass kernels;
* the ``polar`` package, the PolarQuant/TurboQuant kernels: ``polar.codec`` (encode and
  decode), ``polar.tokens`` (a polar cache's spilled tokens encoded in one call),
  ``polar.store`` (a full window's decode step in one call), ``polar.fused`` with
  ``polar.rows`` and ``polar.query`` (the fused decode attention);
* ``fused_driver``: the decode-attention step shared by the fused kernels ``polar.fused``,
  ``int_fused``, ``vq_fused``, ``lowrank_fused`` (their per-tile scoring and accumulation);
* the 16-lane vector helpers they use on AVX-512 and AVX2 CPUs: ``cpu_features`` (what the CPU
  the code is compiled for can do: ``HAVE_PERMPS``, ``VECTOR_TILES``), ``planar`` (the planar
  order of 4/2-bit codes, 16-entry register tables), ``ir_tiles`` (the LLVM IR toolkit, score
  and value products of a tile of floats), ``ir_codes`` (the same straight from packed 4/2/8-bit
  codes), ``ir_softmax`` (the online softmax of a tile), ``simd3`` (3-bit codes), ``simd_int2``
  (2-bit integer codes in channel order), ``simd_signs`` (QJL sign sketches), ``simd_lanes``
  (product-quantization codes with tokens along the lanes), ``half`` (float16 through the F16C
  instructions).
"""
