"""Cold compile of a fused decode kernel: import, a small cache, the first fused call.

Run each in a new process with an empty Numba cache directory, e.g.::

    for k in vq int4 pqo4; do
        NUMBA_CACHE_DIR=$(mktemp -d) NUMBA_NUM_THREADS=1 python benchmarks/cold_compile.py $k
    done

The first call compiles (or, with a warm cache, loads) what the kernel needs for one small step.
"""

from __future__ import annotations

import sys
import time

t_start = time.perf_counter()
import numpy as np  # noqa: E402

import arraykv  # noqa: E402
from arraykv.ops import int_decode_attention, polar_decode_attention, vq_decode_attention  # noqa: E402
from arraykv.quant.vq import VQLayerCodes  # noqa: E402

t_import = time.perf_counter() - t_start


def main(which: str) -> None:
    rng = np.random.default_rng(0)
    h, g, d, n = 2, 2, 64, 300
    k = rng.standard_normal((1, h, n, d)).astype(np.float32)
    q = rng.standard_normal((1, h * g, 1, d)).astype(np.float32)
    t0 = time.perf_counter()
    if which == "vq":
        from arraykv.quant.bitpack import pack_bits

        m, kk = d // 2, 16
        codes = pack_bits(rng.integers(0, kk, (1, h, n, m)).astype(np.uint8), 4)
        cent = rng.standard_normal((h, m, kk, 2)).astype(np.float32)
        e = np.zeros((1, h, 0, d), np.float32)
        t_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = vq_decode_attention(q[:, :, 0], VQLayerCodes(codes, cent, codes, cent, bits=4), e, e, softmax_scale=0.1)
    else:
        cache = arraykv.make_cache(which, num_layers=1, num_kv_heads=h, head_dim=d)
        cache.prefill(0, k, k, rng.standard_normal((1, h * g, n, d)).astype(np.float32))
        codec = cache.layer_codec_state(0)
        t_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = (polar_decode_attention if which.startswith("pq") else int_decode_attention)(codec, q, 0.1)
    t_call = time.perf_counter() - t0
    print(
        f"{which}: import {t_import:.1f} s, setup {t_setup:.1f} s, first call {t_call:.1f} s, "
        f"total {time.perf_counter() - t_start:.1f} s; output sha256 {_digest(out)}"
    )


def _digest(out) -> str:
    """The first 16 hex digits of the SHA-256 of the output's bytes (bit-identical results match)."""
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(np.asarray(out)).tobytes()).hexdigest()[:16]


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "pqo4")
