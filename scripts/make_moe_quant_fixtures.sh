#!/usr/bin/env bash
# The quantized mixture-of-experts test checkpoints (tests/fixtures/quant:
# gptq-qwen3moe-*, awq-mixtral-*, ct-qwen3moe-*), made in throwaway venvs with
# the real tools and the pins of make_quant_fixtures.sh (gptqmodel 7.6.0,
# optimum 2.3.0) and make_ct_fixtures.sh (llm-compressor 0.14.0.1). About 3
# minutes on 2 cores, installs included (ct-qwen3moe-fp8-dynamic, issue 54,
# takes some 5 s of it). NAMEs pick variants; both venvs are made regardless.
#
#     scripts/make_moe_quant_fixtures.sh [OUT_DIR [NAME ...]]   (default: every variant)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/tests/fixtures/quant}")"
TMP="$(mktemp -d)"
python3 -m venv "$TMP/gptqmodel"
"$TMP/gptqmodel/bin/pip" install -q torch==2.13.0 gptqmodel==7.6.0 optimum==2.3.0
python3 -m venv "$TMP/llmcompressor"
"$TMP/llmcompressor/bin/pip" install -q torch==2.13.0 llmcompressor==0.14.0.1
# run from the scratch folder: the tools write logs where they run
cd "$TMP"
GPTQMODEL_CPU_WORKERS=2 "$TMP/gptqmodel/bin/python" "$ROOT/scripts/make_moe_quant_fixtures.py" \
    "$OUT" gptqmodel "${@:2}"
"$TMP/llmcompressor/bin/python" "$ROOT/scripts/make_moe_quant_fixtures.py" "$OUT" llmcompressor \
    "${@:2}"
rm -rf "$TMP"
