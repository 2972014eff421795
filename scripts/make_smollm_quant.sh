#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a float HF folder (the shipped GGUF dequantized,
# fp32) and its GPTQ 4-bit g128, GPTQ 4-bit g64 and AWQ 4-bit g64
# checkpoints, made with gptqmodel 7.6.0 in a throwaway venv, for
# docs/bench/quant_quality.py (issue 16). AWQ g128 cannot be made: the model's
# 576-input layers are not whole groups of 128, which gptqmodel's AWQ (and
# the AWQ format) require; scripts/make_smollm_quant.py says more, and what
# each step does.
#
#     scripts/make_smollm_quant.sh [OUT_DIR] [all|float|gptq-w4-g128|gptq-w4-g64|awq-w4-g64]
#
# OUT_DIR defaults to build/quant-smollm (git-ignored): OUT_DIR/float and
# OUT_DIR/<variant>; a variant alone needs OUT_DIR/float made before. On 2
# cores: float folder + check 33 s, tools venv 97 s, GPTQ g128 6.5 min,
# GPTQ g64 7.5 min, AWQ g64 about 46 min (measured alone: 5 of 30 layers in
# 10 min; slower beside other jobs).
# The calibration text is the shipped docs/bench/quant_quality_calibration.jsonl
# (`make_smollm_quant.py calib` remakes it). TOOLS_VENV=DIR uses (and keeps)
# a venv that already holds torch 2.13.0 + gptqmodel 7.6.0 + optimum 2.3.0;
# by default one is made in a temp dir and removed. Folio's own steps run in
# PYTHON (default .venv/bin/python). Timings are printed per step.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/build/quant-smollm}")"
WHICH="${2:-all}"
VARIANTS="gptq-w4-g128 gptq-w4-g64 awq-w4-g64"
case " all float $VARIANTS " in *" $WHICH "*) ;; *) echo "usage: $0 [OUT_DIR] [all|float|${VARIANTS// /|}]" >&2; exit 2 ;; esac
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" GPTQMODEL_CPU_WORKERS="${GPTQMODEL_CPU_WORKERS:-2}"
mkdir -p "$OUT"

if [ "$WHICH" = all ] || [ "$WHICH" = float ]; then
    t0=$SECONDS
    (cd "$ROOT" && "$PYTHON" scripts/make_smollm_quant.py float "$OUT/float")
    echo "[time] float folder + check: $((SECONDS - t0)) s"
fi
[ "$WHICH" = float ] && exit 0

TMP=""
if [ -n "${TOOLS_VENV:-}" ]; then
    VENV="$(realpath -m "$TOOLS_VENV")"
else
    TMP="$(mktemp -d)"; VENV="$TMP/venv"
    trap 'rm -rf "$TMP"' EXIT
fi
if [ ! -x "$VENV/bin/python" ]; then
    t0=$SECONDS
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 gptqmodel==7.6.0 optimum==2.3.0
    echo "[time] tools venv install: $((SECONDS - t0)) s"
fi
# run from a scratch folder: gptqmodel writes a logs/ folder where it runs
WORK="$(mktemp -d)"
cd "$WORK"
for variant in $VARIANTS; do
    if [ "$WHICH" = all ] || [ "$WHICH" = "$variant" ]; then
        t0=$SECONDS
        rm -rf "${OUT:?}/$variant"
        "$VENV/bin/python" "$ROOT/scripts/make_smollm_quant.py" "$variant" "$OUT/float" \
            "$OUT/$variant"
        echo "[time] $variant: $((SECONDS - t0)) s"
    fi
done
cd "$ROOT"
rm -rf "$WORK"
