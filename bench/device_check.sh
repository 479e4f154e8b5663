#!/usr/bin/env bash
# Issue 3's GPU checks in one call on a CUDA machine, from the repository root:
#   1. bench/gpu_attention.py (copy, quantize, decode vs SDPA, launch sweep, end-to-end tokens/s, then
#      the long-context prefill rows in whatever time is left before the bench's own time limit),
#   2. tests/test_triton.py compiled on the GPU (every kernel test against the CPU reference),
#   3. tests/test_triton_methods.py the same way (the methods' formats: nuq, int3, nvfp4, outliers, Hadamard, pre-RoPE).
# Writes env.txt, gpu_tests.txt, gpu_tests_methods.txt, gpu_attention.json and bench.txt into $OUT (the device tool's folder),
# else reports/device. Needs python3 with torch (CUDA), triton, transformers and pytest; nothing is
# installed. At most about 9.5 minutes (BENCH_TIMEOUT_S + TEST_TIMEOUT_S + METHODS_TIMEOUT_S, under a device call's 10);
# each part has its own time limit so the files come back. The long-context rows stop 15 s before the
# bench's limit and record what they skipped; to give them a call of their own:
#   python3 bench/gpu_attention.py --sections long --long-budget-s 500 --out "$OUT/gpu_long.json"
set -uo pipefail
out=${OUT:-reports/device}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 KVDEMO_TRITON_TEST_DEVICE=cuda

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $py -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"

status=0
bench_s=${BENCH_TIMEOUT_S:-320}
timeout "$bench_s" $py bench/gpu_attention.py --out "$out/gpu_attention.json" --time-budget-s 180 \
    --stop-by-s $((bench_s - 15)) "$@" 2>&1 | tee "$out/bench.txt" || status=1
parallel=$($py -c "import xdist; print('-n 8')" 2>/dev/null)  # compiles in 8 processes when pytest-xdist is there
timeout "${TEST_TIMEOUT_S:-160}" $py -m pytest -q -p no:cacheprovider $parallel tests/test_triton.py 2>&1 |
    tee "$out/gpu_tests.txt" || status=1
timeout "${METHODS_TIMEOUT_S:-90}" $py -m pytest -q -p no:cacheprovider $parallel tests/test_triton_methods.py 2>&1 |
    tee "$out/gpu_tests_methods.txt" || status=1
exit $status
