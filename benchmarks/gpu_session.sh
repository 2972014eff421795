#!/usr/bin/env bash
# What a session lent a GPU runs there, in one call of at most 9 minutes, from
# the source tree with the machine's own python3 (a CUDA image's torch, triton
# and transformers; no install, no network): the machine, the GPU benchmark
# (benchmarks/gpu.sh: its headline figures first, each written as JSON the
# moment it is done), the host's cost per step on the card, then the tests
# that take the CUDA path. Logs and results go to $OUT (the device tool's
# folder; ./gpu-session elsewhere), a short summary to stdout.
#
#     benchmarks/gpu_session.sh [BENCH_SECONDS [TEST_SECONDS [gpu.sh args...]]]
#
# BENCH_SECONDS (default 330) and TEST_SECONDS (default 150) bound the two long
# parts (the host bench takes at most 60), so that one call fits in 9 minutes
# and a lease of 15 has room to rerun it; a part that runs out is reported,
# not hung, and what it measured stays in $OUT. gpu.sh's arguments default to
# --profile.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-session}"
mkdir -p "$OUT"
BENCH_S="${1:-330}"; TEST_S="${2:-150}"; shift $(( $# < 2 ? $# : 2 ))
[[ $# -gt 0 ]] || set -- --profile
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

# the headline figures: batch1.json, throughput.json (+ steps.jsonl), served.json,
# then the profile, teacher-forced logprobs, fp32 tokens, transformers
start=$(date +%s)
timeout -k 20 "$BENCH_S" "$ROOT/benchmarks/gpu.sh" --out "$OUT/bench" --work /tmp/folio-gpu-work \
    "$@" > "$OUT/bench.log" 2>&1
echo "bench: rc=$? in $(( $(date +%s) - start )) s"
for f in batch1 throughput served; do
    [[ -f "$OUT/bench/$f.json" ]] && { echo "$f:"; head -c 1500 "$OUT/bench/$f.json"; echo; }
done
tail -n 30 "$OUT/bench.log"

# the host's cost per step on the card (issue 50): greedy synchronous and
# scheduled ahead, then sampled requests ahead (their draws in one kernel)
start=$(date +%s)
for run in "--sampling greedy" "--sampling greedy --async-scheduling" \
           "--sampling random --async-scheduling"; do
    timeout 20 "$PYTHON" -m folio.cli bench host --device cuda --delays '' --rounds 2 \
        $run >> "$OUT/host.log" 2>&1
done
echo "host: rc=$? in $(( $(date +%s) - start )) s"
grep -E "^\|" "$OUT/host.log" | tail -n 18

# The tests whose code takes another path when CUDA is there: the Triton
# kernels compiled for the card, the TRITON backend and CUDA graphs, the
# memory sizing. (GPU_TESTS, space-separated, replaces the list.) Kernels
# first (quick, and what the figures above rest on), whole engines after.
read -r -d "" -a TESTS <<< "${GPU_TESTS:-tests/model/test_triton_attention.py
    tests/model/test_triton_elementwise.py tests/model/quantization/test_triton_qlinear.py
    tests/model/quantization/test_triton_fp8.py
    tests/model/quantization/test_fp8.py::test_fp8_checkpoints_on_the_gpu
    tests/model/layers/test_triton_moe.py tests/model/layers/test_draws.py
    tests/worker/test_sampling_columns.py tests/engine/test_triton_backend.py
    tests/worker/test_cuda_graphs.py tests/worker/test_gpu_memory.py
    tests/engine/test_async_scheduling.py
    tests/engine/test_gemma3.py::test_greedy_tokens_batched_under_preemption
    tests/engine/test_gemma3.py::test_prompt_logprobs_match_and_the_window_matters
    tests/worker/test_device.py}" || true      # -d "": every line of the list
start=$(date +%s)
# SIGINT at the limit: pytest still prints its summary of what ran
timeout -s INT -k 30 "$TEST_S" "$PYTHON" -m pytest -v -p no:cacheprovider -o addopts="" \
    -rfEs --tb=short --durations=15 --timeout=90 "${TESTS[@]}" > "$OUT/tests.log" 2>&1
echo "tests: rc=$? in $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 40
