#!/usr/bin/env bash
# The gptqmodel-made test checkpoints (tests/fixtures/quant: gptq-*, awq-*),
# made in a throwaway venv with the real tools: gptqmodel 7.6.0 (7.7 does not
# install beside torch 2.13.0) and optimum, which transformers needs to load
# GPTQ for the reference logits (AWQ it loads through gptqmodel alone).
#
#     scripts/make_quant_fixtures.sh [OUT_DIR] [all|gptq|awq]
#
# all (the default) runs make_quant_fixtures.py (GPTQ) then
# make_awq_fixtures.py (AWQ); gptq or awq runs only that one, so either set
# can be remade without touching the other. About 3 minutes on 2 cores,
# install included. The compressed-tensors ones: scripts/make_ct_fixtures.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/tests/fixtures/quant}")"
WHICH="${2:-all}"
case "$WHICH" in all|gptq|awq) ;; *) echo "usage: $0 [OUT_DIR] [all|gptq|awq]" >&2; exit 2 ;; esac
VENV="$(mktemp -d)/venv"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 gptqmodel==7.6.0 optimum==2.3.0
# run from the venv's folder: gptqmodel writes a logs/ folder where it runs
cd "$(dirname "$VENV")"
if [ "$WHICH" != awq ]; then
    GPTQMODEL_CPU_WORKERS=2 "$VENV/bin/python" "$ROOT/scripts/make_quant_fixtures.py" "$OUT"
fi
if [ "$WHICH" != gptq ]; then
    GPTQMODEL_CPU_WORKERS=2 "$VENV/bin/python" "$ROOT/scripts/make_awq_fixtures.py" "$OUT"
fi
rm -rf "$(dirname "$VENV")"
