#!/usr/bin/env bash
# The GGUF K-quant test files (tests/fixtures/gguf/): a tiny random Llama
# (tests/utils.py's make_tiny_model, seed 0, hidden 256 and intermediate 512 so
# that every row is whole super-blocks of 256), written as an F32 GGUF by
# tests/utils.py's write_tiny_gguf, then quantized by llama.cpp's own
# llama-quantize (built from the pinned source of scripts/install_llama_cpp.sh)
# to Q4_K_M (Q4_K, with Q6_K where llama.cpp keeps more bits) and Q5_K_M
# (Q5_K and Q6_K): the files people download, made as they are made. And a
# tiny random Qwen3-MoE (hidden 256, 2 layers of 4 experts of 256 features,
# top-2 renormalized as llama.cpp runs it) to Q4_K_M: its experts' K-quants,
# and attn_k / attn_v Q8_0, as llama-quantize makes them itself for models of
# 8 experts (Mixtral), so that a fused q/k/v mixes Q4_K with Q8_0.
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
moe = make_tiny_model(f"{work}/moe", arch="qwen3_moe", dialect="v5", hidden_size=256,
                      num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=256, mlp_only_layers=[], norm_topk_prob=True,
                      seed=0)
write_tiny_gguf(moe, f"{work}/tiny-qwen3moe-F32.gguf")
EOF
for model in tiny-llama:Q4_K_M tiny-llama:Q5_K_M tiny-qwen3moe:Q4_K_M; do
    name="${model%%:*}" kind="${model##*:}"
    extra=()
    [ "$name" = tiny-qwen3moe ] && extra=(--tensor-type attn_k=q8_0 --tensor-type attn_v=q8_0)
    "$QUANTIZE" "${extra[@]}" "$WORK/$name-F32.gguf" "$OUT/$name-$kind.gguf" "$kind" \
        > "$WORK/$name-$kind.log" 2>&1 || { tail -20 "$WORK/$name-$kind.log" >&2; exit 1; }
done
rm -rf "$WORK"
ls -l "$OUT"
