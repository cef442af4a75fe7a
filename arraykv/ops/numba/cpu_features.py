"""What the CPU the kernels are compiled for can do: the flags that pick their vector code paths.

:func:`host_cpu_has` asks LLVM about one feature of the host, or of the CPU that
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name (portable caches). The flags below are fixed at
import and read by the kernels as compile-time constants:

* :data:`HAVE_AVX512`: a 16-entry table lookup is one ``vpermps``;
* :data:`HAVE_PERMPS`: sixteen codes can be looked up at once in a 16-entry register table
  (AVX-512, or AVX2 with FMA: four 8-lane ``vpermps`` and two blends);
* :data:`VECTOR_TILES`: the fused kernels score and sum their tiles in 16-lane vectors.
"""

from __future__ import annotations

import importlib

from numba.core import config as nb_config

__all__ = ["host_cpu_has", "HAVE_AVX512", "HAVE_PERMPS", "VECTOR_TILES"]


def host_cpu_has(feature: str) -> bool:
    """Whether compiled code may use the host CPU's ``feature`` (an LLVM name: ``"avx512f"``, ``"f16c"``).

    When Numba compiles for a named CPU (``NUMBA_CPU_NAME``: portable caches) only the
    features named in ``NUMBA_CPU_FEATURES`` (``"+avx2,+fma,..."``) count, none without it;
    False where llvmlite cannot say.
    """
    if getattr(nb_config, "CPU_NAME", None):  # Numba's settings module fills its names at run time
        named = getattr(nb_config, "CPU_FEATURES", None) or ""
        return f"+{feature}" in named.replace(" ", "").split(",")
    try:
        llb = importlib.import_module("llvmlite.binding")  # untyped: imported by name

        return bool(llb.get_host_cpu_features().get(feature, False))
    except Exception:  # pragma: no cover - llvmlite without the query
        return False


#: True when compiled code has AVX-512: a 16-entry table lookup is one ``vpermps``.
HAVE_AVX512 = host_cpu_has("avx512f")
#: True when the kernels may look up sixteen codes at once in a 16-entry register table: one
#: AVX-512 ``vpermps``, or with AVX2 four 8-lane ``vpermps`` and two blends
#: (:func:`arraykv.ops.numba.ir_tiles.vec_helpers` ``perm_fn``); the other vector code is plain
#: LLVM vectors of sixteen float32, which LLVM splits into two 8-lane halves where AVX-512 is missing.
HAVE_PERMPS = HAVE_AVX512 or (host_cpu_has("avx2") and host_cpu_has("fma"))
#: True when the fused kernels score and sum tiles with :func:`arraykv.ops.numba.ir_tiles.tile_scores` /
#: :func:`arraykv.ops.numba.ir_tiles.tile_values` (head_dim a multiple of 64): where the code lookups
#: are vectors too (AVX-512 or AVX2).
VECTOR_TILES = HAVE_PERMPS
