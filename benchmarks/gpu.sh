#!/usr/bin/env bash
# The GPU benchmark of issue 17 (src/folio/bench/gpu.py), from the source tree:
# no install, no network. About 8 minutes on one H200; --tiny is a dry run in
# seconds (on the CPU without a GPU, the kernels in triton's interpreter).
#
#     benchmarks/gpu.sh [--tiny] [--out DIR] [--num-prompts N] [--hf-limit K]
#
# The python is $PYTHON, else the checkout's .venv (what `make run` and
# `make test` make, with torch, triton and transformers), else the machine's
# own python3 (a GPU image's torch).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" -m folio.cli bench gpu "$@"
