#!/usr/bin/env bash
# The GPU checks in one call on a CUDA machine: every test that runs on CuPy or launches a
# kernels/*.cu kernel, the decode benchmark, and a memory check of a few kernel cases.
# Logs go under $OUT (or ./gpu-out); the last lines printed are the summaries.
#
#   bash benchmarks/gpu_check.sh
#
# Wheels in .whl/ (array-api-compat, array-api-strict where the machine lacks them) are
# installed into /tmp/site first. Each step has its own time limit so that one hang leaves
# the others their time.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
workers=$(( $(nproc) > 12 ? 12 : $(nproc) ))

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    nvcc --version | tail -2
    python3 -c "import cupy, numba, numpy, array_api_compat; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'array_api_compat', array_api_compat.__version__)"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# 1. tests: the CUDA kernels against their references, and every namespace-parametrized
#    test on CuPy (the ids carry "cupy"), in parallel workers
#    (TESTS narrows the paths, e.g. TESTS=tests/ops/test_cuda_polar.py after a kernel change)
timeout "${TEST_S:-210}" python3 -m pytest -q -p no:cacheprovider -n "$workers" --timeout 150 \
    -k "cupy or cuda or gpu" ${TESTS:-tests} >"$out/tests.log" 2>&1
echo "tests exit $?"

# 2. the fused decode against dense float16 attention (CUDA events, L2 flushed)
timeout "${BENCH_S:-150}" python3 benchmarks/decode_gpu.py --contexts ${CONTEXTS:-4096 32768 131072} \
    --mode pqo4 --json "$out/bench_pqo4.json" >"$out/bench.log" 2>&1
echo "bench pqo4 exit $?"
for mode in ${MODES2:-pqo2}; do  # other bit widths at 32k tokens
    timeout "${BENCH2_S:-60}" python3 benchmarks/decode_gpu.py --contexts 32768 --mode "$mode" \
        --json "$out/bench_$mode.json" >>"$out/bench.log" 2>&1
    echo "bench $mode exit $?"
done
# keys of a rotary model: the rotating key mean's logit term per token
timeout "${BENCH3_S:-100}" python3 benchmarks/decode_gpu.py --contexts ${CONTEXTS:-4096 32768 131072} \
    --mode pqo4 --rope --json "$out/bench_pqo4_rope.json" >>"$out/bench.log" 2>&1
echo "bench pqo4 rope exit $?"

# the rows of every benchmark in one file: what comes back from the machine is at most 8 files
cat "$out"/bench_*.json >"$out/bench.jsonl" 2>/dev/null && rm -f "$out"/bench_*.json

# 3. memory check: a few cases of each kernel under compute-sanitizer
timeout "${SAN_S:-90}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/ops/test_cuda_polar.py \
    -k "1-4-64-pqo4 or 4-8-128-tq3 or 1-1-256-pq2 or poisoned and 96-3 or window_only or rotating and tq3 or odd_capacity and tq3" \
    >"$out/sanitizer.log" 2>&1
echo "sanitizer exit $?"

# 4. a profile of the attention kernel (pqo4, 32k tokens, batch 8): speed of light, occupancy,
#    stall reasons, memory traffic
cat >/tmp/profile_step.py <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import cupy as cp
import decode_gpu
from arraykv.ops import polar_decode_attention
rng = cp.random.default_rng(0)
cache, _, _ = decode_gpu.build_cache(cp, "pqo4", 8, 8, 4, 128, 32768, rng, "--rope" in sys.argv)
codec = cache.layer_codec_state(0)
q = rng.standard_normal((8, 32, 1, 128), dtype=cp.float32).astype(cp.float16)
for _ in range(6):
    polar_decode_attention(codec, q, 128 ** -0.5)
cp.cuda.Device().synchronize()
PY
timeout "${NCU_S:-90}" ncu --clock-control none --kernel-name regex:polar_decode_attn --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section LaunchStats --section SchedulerStats python3 /tmp/profile_step.py >"$out/ncu.txt" 2>&1
echo "ncu exit $?"

echo "== tests"; grep -E "passed|failed|error" "$out/tests.log" | tail -3
# a run stopped by its time limit prints no summary: count its progress characters
prog=$(grep -oE '^[.FEsx]+' "$out/tests.log" | tr -d '\n')
echo "progress: ${#prog} tests reported, $(printf '%s' "$prog" | tr -cd 'FE' | wc -c) failed or errored"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -40
echo "== sanitizer"; grep -E "ERROR SUMMARY|passed|failed" "$out/sanitizer.log" | tail -3
echo "== bench"; grep -E "^#|^\|" "$out/bench.log" | grep -v '^# {' | tail -40
echo "== ncu"; grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots Busy|L2 Hit" "$out/ncu.txt" | head -20
