"""The floor of a decode-attention step on this CPU: bytes read ÷ bandwidth, operations ÷ peak rate.

Used by ``benchmarks/decode_cpu.py`` to print the floor beside each timing. The machine's numbers:

* *memory bandwidth*, measured: the best of five NumPy ``sum`` passes over a 512 MiB float32
  array, cut into one part per thread (the first touch and page faults are outside the timing);
* *peak multiply-add rate*, from the ISA: SIMD lanes (16 float32 with AVX-512, 8 with AVX2/FMA)
  × FMA units per core (two on Xeon server cores with AVX-512: an assumption, stated in the
  output) × clock (``cpu MHz`` of ``/proc/cpuinfo``) × threads, or the rate the library's own
  vector loop reaches on data in L1 (:func:`measured_fma`), whichever is higher: a core that
  runs above its nominal clock does more than the ISA figure says, and a floor below what a
  loop demonstrably achieves would flatter every kernel measured against it;
* *table lookups* (a kernel whose scores and value sums are scalar loads and adds, as the vq
  kernel's tables are without AVX-512): two loads per cycle per core. The vq kernel's vector
  path is counted in multiply-add lanes instead: its ``vpermps`` lookups and adds run sixteen
  tokens per instruction, like a multiply-add.

A step's floor is ``max(bytes / bandwidth, FMAs / peak)`` (or lookups / lookup rate): the time
it cannot beat even with perfect overlap of memory and arithmetic. The unpacking of codes into
floats, the softmax's ``exp`` and the per-tile bookkeeping are *not* counted: they are the
distance between a kernel and its floor.
"""

from __future__ import annotations

import os
import time

import numpy as np

_BW: dict = {}


def cpu_info() -> dict:
    """``model``, ``cores``, ``mhz``, ``lanes`` (float32 per SIMD register), ``fma_units`` (assumed)."""
    model, mhz, flags = "?", 0.0, set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = val.strip()
                elif key == "cpu MHz" and not mhz:
                    mhz = float(val)
                elif key == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    try:  # the instructions the kernels are compiled for (NUMBA_CPU_NAME may name a smaller CPU)
        from arraykv.ops.numba.cpu_features import host_cpu_has

        lanes = min(lanes, 16 if host_cpu_has("avx512f") else 8 if host_cpu_has("avx2") else 4)
    except ImportError:
        pass
    return dict(model=model, cores=os.cpu_count(), mhz=mhz, lanes=lanes, fma_units=2 if "fma" in flags else 1)


def bandwidth(threads: int, mib: int = 512) -> float:
    """Read bandwidth in bytes/s with ``threads`` threads (memoised): best of 5 NumPy sums over ``mib`` MiB,
    the array cut into ``threads`` contiguous parts summed on as many Python threads (NumPy releases the GIL)."""
    if threads in _BW:
        return _BW[threads]
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(mib << 18, np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    _BW[threads] = a.nbytes / best
    return _BW[threads]


def isa_fma(threads: int) -> float:
    """Float32 multiply-adds per second at the ISA's peak and the nominal clock with ``threads`` cores."""
    c = cpu_info()
    return c["lanes"] * c["fma_units"] * c["mhz"] * 1e6 * threads


_FMA: dict = {}


def measured_fma(threads: int) -> float:
    """Multiply-adds per second of :func:`arraykv.ops.numba.ir_tiles.tile_values` (4 query heads,
    a 64 × 128 tile in L1, accumulators in registers) on ``threads`` Python threads at once;
    0 where the vector tiles are not used (neither AVX-512 nor AVX2)."""
    if threads in _FMA:
        return _FMA[threads]
    from arraykv.ops.numba import cpu_features, ir_tiles

    if not cpu_features.VECTOR_TILES:
        _FMA[threads] = 0.0
        return 0.0
    from concurrent.futures import ThreadPoolExecutor

    import numba as nb

    @nb.njit(nogil=True)
    def run(buf, w, acc, reps):
        for _ in range(reps):
            ir_tiles.tile_values(buf, 64, w, acc)

    rng = np.random.default_rng(0)
    work = [
        (
            rng.standard_normal((64, 128)).astype(np.float32),
            rng.random((4, 64)).astype(np.float32) * 1e-3,
            np.zeros((4, 128), np.float32),
        )
        for _ in range(threads)
    ]
    reps = 20000
    run(*work[0], 10)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(lambda a: run(*a, reps), work))
            best = min(best, time.perf_counter() - t0)
    _FMA[threads] = threads * reps * 4 * 64 * 128 / best
    return _FMA[threads]


def peak_fma(threads: int) -> float:
    """Float32 multiply-adds per second: the larger of :func:`isa_fma` and :func:`measured_fma`."""
    return max(isa_fma(threads), measured_fma(threads))


def floor_seconds(nbytes: float, fmas: float = 0.0, lookups: float = 0.0, threads: int = 1) -> dict:
    """``{"memory", "compute", "floor"}`` seconds of a step reading ``nbytes`` and doing ``fmas``/``lookups``."""
    mem = nbytes / bandwidth(threads)
    comp = fmas / peak_fma(threads) + lookups / (2.0 * cpu_info()["mhz"] * 1e6 * threads)
    return dict(memory=mem, compute=comp, floor=max(mem, comp))


def describe(threads: int) -> str:
    """One line: the machine and the two rates the floor divides by."""
    c = cpu_info()
    return (
        f"# floor: {c['model']}, {c['cores']} cores at {c['mhz']:.0f} MHz; read bandwidth "
        f"{bandwidth(threads) / 1e9:.1f} GB/s with {threads} thread(s) (measured); peak "
        f"{peak_fma(threads) / 1e9:.0f} G float32 FMA/s, the larger of {isa_fma(threads) / 1e9:.0f} "
        f"(= {c['lanes']} lanes x {c['fma_units']} FMA units (assumed) x nominal clock x {threads}) and "
        f"{measured_fma(threads) / 1e9:.0f} (measured: the vector tile loop on data in L1); "
        f"scalar table lookups at 2 loads/cycle/core"
    )
