#!/usr/bin/env bash
# Issue #33's GPU check, prepared on a machine without one: one script for a lent GPU, about 8 minutes
# on an H200 at most (each stage under its own timeout, the most wanted first, so a cut run still
# reports the first ones). Run from the repository root, the project and its dependencies importable
# (torch with CUDA; triton comes with torch's CUDA wheels, else `pip install '.[cuda]'`):
#   bash bench/cuda_check.sh [OUT_DIR]
# Stages (logs and JSON in OUT_DIR, default /tmp/llamaserve-cuda-check):
#  1. tests-graphs: the Triton attention and CUDA graphs on the GPU (tests/engine/test_cuda_graphs.py:
#     graphs on vs off at every batch size 1..32, load/unload memory; tests/engine/test_cuda.py: the
#     forward on CUDA against the CPU's, float64 equal, now through the Triton kernel in bf16/fp32);
#  2. throughput: bench/throughput.py --device cuda, the 1.1B-shaped model (big1b) in bf16 at 1, 8, 32,
#     64 and 128 streams with graphs, each with its floor (weights read once a step) beside it;
#  3. throughput-eager: the same at 1 and 64 streams with graphs off (what the graphs bought);
#  4. profile: bench/cuda_step_profile.py at batch 1 and 64 (the GPU's busy time vs the step's wall time);
#  5. tests-cuda: the rest of .ci/cuda's tests (quantized CUDA linears, the CUDA e2e server, LoRA);
#  6. llama3-8b: a Llama 3 8B-shaped random model (16 GB in bf16, written once) at batch 1: its
#     TPOT against its floor (16 GB at the measured bandwidth).
# The targets: batch-1 decode of the 1.1B at most 1.0 ms per token; 64 streams at least
# 20,000 output tok/s.
set -uo pipefail
out=${1:-/tmp/llamaserve-cuda-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
results=()

stage() {  # stage NAME LIMIT_S COMMAND...: run it under a timeout, log to OUT_DIR/NAME.log, keep its exit code
    local name=$1 limit=$2
    shift 2
    echo "=== $name (at most ${limit} s): $*"
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    results+=("$name=$rc")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
python3 -c "import triton; print('triton', triton.__version__)" || echo "triton is not importable: attention stays on SDPA and no decode graph is captured"

pytest=(python3 -m pytest -p no:cacheprovider -q -rs --timeout 120)
stage tests-graphs 100 "${pytest[@]}" tests/engine/test_cuda_graphs.py tests/engine/test_cuda.py
stage throughput 120 python3 bench/throughput.py --device cuda --config big1b --concurrency 1,8,32,64,128 --skip-prefix \
    --checkpoint-dir /tmp/llamaserve-bench-big1b --json "$out/throughput_big1b_graphs.json"
stage throughput-eager 50 python3 bench/throughput.py --device cuda --config big1b --concurrency 1,64 --skip-prefix --no-cuda-graphs \
    --checkpoint-dir /tmp/llamaserve-bench-big1b --json "$out/throughput_big1b_eager.json"
stage profile 30 python3 bench/cuda_step_profile.py --config big1b --batch 1,64 --steps 10 --top 12
stage tests-cuda 80 "${pytest[@]}" tests/engine/test_quant_cuda.py tests/e2e/test_cuda_e2e.py tests/engine/test_lora.py
stage llama3-8b 120 python3 bench/throughput.py --device cuda --config llama3_8b --concurrency 1 --skip-prefix \
    --checkpoint-dir /tmp/llamaserve-bench-llama3_8b --json "$out/throughput_llama3_8b.json"

echo "=== summary (exit codes: ${results[*]})"
grep -h -E "passed|failed|error" "$out"/tests-*.log | tail -n 4
for log in throughput throughput-eager llama3-8b; do
    echo "-- $log"
    grep -h -E "^concurrency " "$out/$log.log" 2>/dev/null
done
grep -h "GPU busy" "$out/profile.log" 2>/dev/null
for result in "${results[@]}"; do
    [ "${result#*=}" = 0 ] || exit 1
done
