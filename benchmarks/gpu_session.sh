#!/usr/bin/env bash
# What a session lent a GPU runs there, in one call, from the source tree with
# the machine's own python3 (a CUDA image's torch, triton and transformers; no
# install, no network): the machine, the tests that take the CUDA path, then
# the GPU benchmark (benchmarks/gpu.sh). Logs and results go to $OUT (the
# device tool's folder; ./gpu-session elsewhere), a short summary to stdout.
#
#     benchmarks/gpu_session.sh [TEST_SECONDS [BENCH_SECONDS [gpu.sh args...]]]
#
# TEST_SECONDS (default 240) and BENCH_SECONDS (default 420) bound each part,
# so that one call fits a lease; a part that runs out is reported, not hung.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-session}"
mkdir -p "$OUT"
TEST_S="${1:-240}"; BENCH_S="${2:-420}"; shift $(( $# < 2 ? $# : 2 ))
export PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/folio-cache}"

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    nproc
    "$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
    "$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); print(p.name, \
p.multi_processor_count, 'SMs', p.total_memory >> 20, 'MiB')"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# The tests whose code takes another path when CUDA is there: the Triton
# kernels compiled for the card, the TRITON backend and CUDA graphs, the
# memory sizing, the GPU benchmark's own dry run.
# (GPU_TESTS, space-separated, replaces the list.) Whole engines first, kernels last.
read -r -a TESTS <<< "${GPU_TESTS:-tests/worker/test_cuda_graphs.py tests/worker/test_gpu_memory.py
    tests/model/quantization/test_triton_qlinear.py tests/model/layers/test_triton_moe.py
    tests/engine/test_triton_backend.py
    tests/engine/test_gemma3.py::test_greedy_tokens_batched_under_preemption
    tests/engine/test_gemma3.py::test_prompt_logprobs_match_and_the_window_matters
    tests/worker/test_device.py tests/bench/test_gpu.py tests/model/test_triton_attention.py
    tests/engine/test_async_scheduling.py}"
start=$(date +%s)
# SIGINT at the limit: pytest still prints its summary of what ran
timeout -s INT -k 30 "$TEST_S" "$PYTHON" -m pytest -v -p no:cacheprovider -o addopts="" \
    -rfEs --tb=short --durations=15 --timeout=90 "${TESTS[@]}" > "$OUT/tests.log" 2>&1
echo "tests: rc=$? in $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 40

# the host's cost per step on the card, synchronous and scheduled ahead (issue 50)
start=$(date +%s)
for ahead in "" --async-scheduling; do
    timeout 60 "$PYTHON" -m folio.cli bench host --device cuda --delays '' --rounds 2 \
        $ahead >> "$OUT/host.log" 2>&1
done
echo "host: rc=$? in $(( $(date +%s) - start )) s"
grep -E "^\|" "$OUT/host.log" | tail -n 12

start=$(date +%s)
timeout "$BENCH_S" "$ROOT/benchmarks/gpu.sh" --out "$OUT/bench" --work /tmp/folio-gpu-work "$@" \
    > "$OUT/bench.log" 2>&1
echo "bench: rc=$? in $(( $(date +%s) - start )) s"
tail -n 25 "$OUT/bench.log"
