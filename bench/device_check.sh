#!/usr/bin/env bash
# The GPU checks in two device calls, from the repository root. Every part has its own time limit (`timeout`), so
# the files come back even when a part runs long; each writes JSON (and its log) into $OUT (the device tool's
# folder), else reports/device. Needs python3 with torch (CUDA), triton, transformers and pytest; nothing is
# installed. Environment variables override each limit (seconds).
#
# First call, `bash bench/device_check.sh` (at most about 4.5 minutes: run it with timeout_s 300):
#   1. decode.json: decode attention at the goal point (Llama-3.1-8B heads, batch 8, 64k) for SDPA and int4,
#      int8, k8v4, fp8, eager and from CUDA graphs (int4, int8 and k8v4 in both forms of the plane-split loop:
#      the default and direct keys), and the launch-setting sweep (gpu_attention.py --sections
#      copy,decode,sweep; the methods' formats left out; DECODE_TIMEOUT_S, default 100);
#   2. ncu_stalls.json: Nsight Compute's stall reasons of the int4 decode call (bench/ncu_stalls.py; a row saying
#      ncu is absent where it is; NCU_TIMEOUT_S, default 60);
#   3. e2e.json: end-to-end decode tokens/s, 8B then 135M shapes, 32k and 4k prompts, batch 8 and 1, full and
#      int4, backends torch, triton, triton+graphs, hf-dynamic, hf-static (largest rows first: the goal rows, 8B at
#      32k batch 8, before the rest), then the split model (half its layers on the CPU) (--sections copy,e2e,split;
#      E2E_TIMEOUT_S, default 110; rows past E2E_BUDGET_S, default 80, are recorded as skipped).
# Second call, `bash bench/device_check.sh long` (at most about 7.6 minutes: run it with timeout_s 480):
#   4. long.json: the 128k int4/full prefill rows and the 1M-token 2-layer row (--sections long; LONG_TIMEOUT_S,
#      default 300, the rows stop 15 s before it);
#   5. gpu_tests.txt: tests/test_triton.py compiled on the GPU (TEST_TIMEOUT_S, default 150), and, if
#      METHODS_TIMEOUT_S > 0, tests/test_triton_methods.py (default 0: not in the 15 minutes of a session).
# Both calls write env.txt. Any other arguments go to every gpu_attention.py run of the call.
set -uo pipefail
out=${OUT:-reports/device}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 KVDEMO_TRITON_TEST_DEVICE=cuda
call=first
if [ "${1:-}" = long ]; then
    call=long
    shift
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $py -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"

status=0
if [ "$call" = first ]; then
    t=${DECODE_TIMEOUT_S:-100}
    timeout "$t" $py bench/gpu_attention.py --out "$out/decode.json" --sections copy,decode,sweep \
        --contexts 65536 --batches 8 --method-formats '' --time-budget-s $((t - 20)) "$@" 2>&1 | tee "$out/decode.txt" || status=1
    timeout "${NCU_TIMEOUT_S:-60}" $py bench/ncu_stalls.py --out "$out/ncu_stalls.json" \
        --timeout-s $((${NCU_TIMEOUT_S:-60} - 5)) 2>&1 | tee "$out/ncu_stalls.txt" || status=1
    t=${E2E_TIMEOUT_S:-110}
    timeout "$t" $py bench/gpu_attention.py --out "$out/e2e.json" --sections copy,e2e,split \
        --models random:llama-3.1-8b,embedded --e2e-prompt 4096,32768 --e2e-batches 1,8 --e2e-precisions full,int4 \
        --e2e-budget-s "${E2E_BUDGET_S:-$((t - 30))}" "$@" 2>&1 | tee "$out/e2e.txt" || status=1
else
    t=${LONG_TIMEOUT_S:-300}
    timeout "$t" $py bench/gpu_attention.py --out "$out/long.json" --sections long --long-budget-s $((t - 15)) \
        --stop-by-s $((t - 15)) "$@" 2>&1 | tee "$out/long.txt" || status=1
    parallel=$($py -c "import xdist; print('-n 8')" 2>/dev/null) # compiles in 8 processes when pytest-xdist is there
    timeout "${TEST_TIMEOUT_S:-150}" $py -m pytest -q -p no:cacheprovider $parallel tests/test_triton.py 2>&1 |
        tee "$out/gpu_tests.txt" || status=1
    if [ "${METHODS_TIMEOUT_S:-0}" -gt 0 ]; then
        timeout "$METHODS_TIMEOUT_S" $py -m pytest -q -p no:cacheprovider $parallel tests/test_triton_methods.py 2>&1 |
            tee "$out/gpu_tests_methods.txt" || status=1
    fi
fi
exit $status
