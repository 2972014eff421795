#!/usr/bin/env bash
# The GPU benchmark of issue 17 (src/folio/bench/gpu.py), from the source tree
# with the machine's own torch, triton and transformers: no install, no
# network. About 8 minutes on one H200; --tiny is a dry run in seconds (on the
# CPU without a GPU, the kernels in triton's interpreter).
#
#     benchmarks/gpu.sh [--tiny] [--out DIR] [--num-prompts N] [--hf-limit K]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m folio.cli bench gpu "$@"
