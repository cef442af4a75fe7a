"""Where a fused pqo4 (or pqo2) decode step spends its time per token row (CPU, Numba vector kernels).

Prints cycles per row (one KV head's token: 128 four-bit key codes and 128 value codes scored
and summed for 4 query heads; two-bit codes with ``--mode pqo2``) at the clock given by ``--ghz``:

- the whole step, ``arraykv.ops.polar_decode_attention`` on a ``pqo4`` layer (32 query / 8 KV
  heads, head_dim 128), warm, in a loop, at several context lengths;
- its parts, each alone in a loop over the rows of one head: ``tile_scores_codes_4`` (scores
  straight from the packed key codes; ``_2`` for pqo2), ``tile_values_codes_4`` (weighted value sums),
  ``softmax_rows`` (the online softmax of a tile), and the kernel's small per-tile loops
  (float16 lengths through the table, ``s·ℓ_k + q·μ``, ``s·ℓ_v``).

64 FMA instructions per row are 32 cycles on two FMA pipes: what the parts take beyond that is
what separates the step from its multiply-add floor (``docs/benchmarks.md``).

Usage: ``NUMBA_NUM_THREADS=1 python benchmarks/fused_parts.py [--ghz 4.1] [--contexts 1024 4096 32768] [--mode pqo2]``
(needs a CPU where the vector kernels are compiled: AVX-512, or AVX2 with FMA).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _median_seconds(fn, *args, repeat=15):
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def whole_step(contexts, ghz, rng, mode="pqo4"):
    import arraykv
    from arraykv import ops

    b, hkv, g, d = 1, 8, 4, 128
    rows = []
    for n in contexts:
        cache = arraykv.make_cache(mode, num_layers=1, num_kv_heads=hkv, head_dim=d, residual_window=0, sink_tokens=0)
        k = rng.standard_normal((b, hkv, n, d), dtype=np.float32)
        v = rng.standard_normal((b, hkv, n, d), dtype=np.float32)
        cache.prefill(0, k, v, rng.standard_normal((b, hkv * g, n, d), dtype=np.float32))
        codec = cache.layer_codec_state(0)
        q = rng.standard_normal((b, hkv * g, 1, d), dtype=np.float32)
        t = _median_seconds(lambda: ops.polar_decode_attention(codec, q, d**-0.5), repeat=max(15, 100000 // n))
        rows.append((f"whole step, {n} tokens ({t * 1e3:.3f} ms)", t * ghz * 1e9 / (n * hkv)))
    return rows


def parts(ghz, rng, n=32768, bits=4):
    import numba as nb

    from arraykv.ops.numba import ir_codes, planar
    from arraykv.ops.numba.cpu_features import VECTOR_TILES
    from arraykv.ops.numba.fused_driver import FASTMATH, TILE
    from arraykv.ops.numba.half import HALF_TO_FLOAT
    from arraykv.ops.numba.ir_softmax import softmax_rows

    tile_scores = getattr(ir_codes, f"tile_scores_codes_{bits}")
    tile_values = getattr(ir_codes, f"tile_values_codes_{bits}")

    if not VECTOR_TILES:
        raise SystemExit("the vector kernels are not compiled on this CPU (no AVX-512, no AVX2 + FMA)")
    d, g = 128, 4

    @nb.njit(fastmath=FASTMATH)
    def scores(codes, tab, qr, s):
        for t0 in range(0, codes.shape[0], TILE):
            tile_scores(codes, t0, TILE, tab, qr, s)

    @nb.njit(fastmath=FASTMATH)
    def values(codes, tab, w, acc):
        for t0 in range(0, codes.shape[0], TILE):
            tile_values(codes, t0, TILE, tab, w, acc)

    @nb.njit(fastmath=FASTMATH)
    def softmax(s, m, l, acc, tiles):
        for _ in range(tiles):
            softmax_rows(s, TILE, m, l, acc)

    @nb.njit(fastmath=FASTMATH)
    def small_loops(norms, half, s, qconst, rterm):
        kn = np.empty(TILE, np.float32)
        vn = np.empty(TILE, np.float32)
        for t0 in range(0, norms.shape[2], TILE):
            for r in range(TILE):
                kn[r] = half[norms[0, 0, t0 + r]]
                vn[r] = half[norms[1, 0, t0 + r]]
            for gg in range(s.shape[0]):
                sg, rg, cg = s[gg], rterm[gg], qconst[gg]
                for r in range(TILE):
                    sg[r] = sg[r] * kn[r] + cg + rg[r]
            for gg in range(s.shape[0]):
                sg = s[gg]
                for r in range(TILE):
                    sg[r] *= vn[r]

    codes = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
    tab = planar.table16(rng.standard_normal(1 << bits).astype(np.float32))
    qr = rng.standard_normal((g, d)).astype(np.float32)
    s = rng.standard_normal((g, TILE)).astype(np.float32)
    w = (rng.random((g, TILE)) * 0.01).astype(np.float32)
    acc = np.zeros((g, d), np.float32)
    m, l = np.full(g, -np.inf, np.float32), np.zeros(g, np.float32)
    norms = rng.integers(0x3000, 0x3C00, (2, 1, n), dtype=np.uint16)  # float16 lengths of like magnitude
    per_row = ghz * 1e9 / n
    return [
        (f"scores (tile_scores_codes_{bits})", _median_seconds(scores, codes, tab, qr, s) * per_row),
        (f"values (tile_values_codes_{bits})", _median_seconds(values, codes, tab, w, acc) * per_row),
        ("softmax (softmax_rows)", _median_seconds(softmax, s.copy(), m, l, acc, n // TILE) * per_row),
        (
            "small per-tile loops",
            _median_seconds(
                small_loops, norms, HALF_TO_FLOAT, s, np.zeros(g, np.float32), np.zeros((g, TILE), np.float32)
            )
            * per_row,
        ),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ghz", type=float, default=4.1, help="clock the cycles are counted at")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 32768])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["pqo4", "pqo2"], default="pqo4")
    args = ap.parse_args(argv)
    import numba

    rng = np.random.default_rng(args.seed)
    print(
        f"# Numba threads {numba.get_num_threads()}; cycles per row at {args.ghz} GHz "
        f"(64 FMA instructions per row = 32 cycles on two FMA pipes); {args.mode}"
    )
    print("| part | cycles per row |")
    print("|---|---|")
    bits = int(args.mode[-1])
    for name, cycles in whole_step(args.contexts, args.ghz, rng, args.mode) + parts(args.ghz, rng, bits=bits):
        print(f"| {name} | {cycles:.1f} |", flush=True)


if __name__ == "__main__":
    main()
