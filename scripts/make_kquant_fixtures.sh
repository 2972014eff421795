#!/usr/bin/env bash
# The GGUF K-quant test files (tests/fixtures/gguf/): a tiny random Llama
# (tests/utils.py's make_tiny_model, seed 0, hidden 256 and intermediate 512 so
# that every row is whole super-blocks of 256), written as an F32 GGUF by
# tests/utils.py's write_tiny_gguf, then quantized by llama.cpp's own
# llama-quantize (built from the pinned source of scripts/install_llama_cpp.sh)
# to Q4_K_M (Q4_K, with Q6_K where llama.cpp keeps more bits) and Q5_K_M
# (Q5_K and Q6_K): the files people download, made as they are made.
#
#     scripts/make_kquant_fixtures.sh [OUT_DIR]
#
# Seconds once llama-quantize is built (scripts/install_llama_cpp.sh builds it).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/tests/fixtures/gguf}")"
QUANTIZE="${LLAMA_QUANTIZE:-$ROOT/build/llama.cpp/native/bin/llama-quantize}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$QUANTIZE" ] || { echo "no $QUANTIZE: run scripts/install_llama_cpp.sh" >&2; exit 1; }
WORK="$(mktemp -d)"
mkdir -p "$OUT"
cd "$ROOT"
"$PYTHON" - "$WORK" <<'EOF'
import sys
from tests.utils import make_tiny_model, write_tiny_gguf
work = sys.argv[1]
hf = make_tiny_model(f"{work}/hf", arch="llama", hidden_size=256, intermediate_size=512,
                     seed=0)
write_tiny_gguf(hf, f"{work}/tiny-llama-F32.gguf")
EOF
for kind in Q4_K_M Q5_K_M; do
    "$QUANTIZE" "$WORK/tiny-llama-F32.gguf" "$OUT/tiny-llama-$kind.gguf" "$kind" \
        > "$WORK/$kind.log" 2>&1 || { tail -20 "$WORK/$kind.log" >&2; exit 1; }
done
rm -rf "$WORK"
ls -l "$OUT"
