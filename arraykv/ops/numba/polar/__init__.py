"""The Numba kernels of the PolarQuant/TurboQuant caches (imported only when an op first asks for one).

Modules: ``codec`` (encode and decode of vectors: :func:`~.codec.polar_encode`,
:func:`~.codec.polar_decode`, and the compiled loops the others reuse), ``tokens`` (a cache's
spilled tokens centred, weighted and encoded in one call), ``store`` (a full window's decode step
in one call), ``rows`` (packed code rows as centroid values, and the host-side arguments of the
fused kernel), ``query`` (the per-head parts of the fused kernel outside its token loop) and
``fused`` (the fused decode attention straight from the packed codes).
"""
