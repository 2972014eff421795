#!/usr/bin/env bash
# The compressed-tensors test checkpoints (tests/fixtures/quant: ct-*), made in
# a throwaway venv with the real tool: llm-compressor 0.14.0.1 (it brings
# compressed-tensors 0.19.0 and its own transformers; torch stays the CPU
# 2.13.0 wheel). About 1.75 minutes on 2 cores, install included; the three
# ct-fp8-* alone (issue 54) 1.3 minutes, some 15 s of it theirs.
#
#     scripts/make_ct_fixtures.sh [OUT_DIR [NAME ...]]   (default: every variant)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/tests/fixtures/quant}")"
VENV="$(mktemp -d)/venv"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 llmcompressor==0.14.0.1
# run from the venv's folder, like make_quant_fixtures.sh, so nothing the
# tools write where they run lands in the repo
cd "$(dirname "$VENV")"
"$VENV/bin/python" "$ROOT/scripts/make_ct_fixtures.py" "$OUT" "${@:2}"
rm -rf "$(dirname "$VENV")"
