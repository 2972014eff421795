#!/usr/bin/env bash
# The quantized test checkpoints (tests/fixtures/quant), made in a throwaway
# venv with the real tools: gptqmodel 7.6.0 (7.7 does not install beside
# torch 2.13.0) and optimum, which transformers needs to load GPTQ for the
# reference logits. About 3 minutes on 2 cores, install included.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$(mktemp -d)/venv"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 gptqmodel==7.6.0 optimum==2.3.0
OUT="$(realpath -m "${1:-$ROOT/tests/fixtures/quant}")"
# run from the venv's folder: gptqmodel writes a logs/ folder where it runs
cd "$(dirname "$VENV")"
GPTQMODEL_CPU_WORKERS=2 "$VENV/bin/python" "$ROOT/scripts/make_quant_fixtures.py" "$OUT"
rm -rf "$(dirname "$VENV")"
