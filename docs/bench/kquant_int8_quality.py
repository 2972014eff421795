"""What the K-quants' int8 arithmetic costs in quality (issue 53): native/
qlinear.c's sblock rounds x to int8 once per super-block of 256 inputs (as
llama.cpp's q8_K does) where every other format rounds it per block of 32.
On a real model, measured three ways on the same file: `--activation-
quantization none` (fp32 arithmetic on the codes), int8 with x per 32 inputs
(the library built with -DFOLIO_QL_SUPER=0), int8 with x per super-block (the
default build); quant_quality.py's measures as int8_activations_ppl.py
prints them (the perplexity of docs/bench/quant_quality_eval.txt in windows
of 512 tokens, the 12 chats' first 32 greedy tokens against `none`'s).

The file: the default model (SmolLM2-135M-Instruct, GGUF Q4_1) requantized
to Q4_K_M by llama.cpp's llama-quantize (`--allow-requantize`; scripts/
install_llama_cpp.sh builds it). Its 576-input projections are not whole
super-blocks, so llama-quantize falls back to Q5_0 and Q8_0 there (run as
float weights by Folio); the 30 MLP down projections (1,536 inputs, the
activations after SiLU x up, where a model's outliers are) are Q4_K and
Q6_K, the layers the two int8 arithmetics differ on.

    .venv/bin/python docs/bench/kquant_int8_quality.py [--dir /tmp/kq]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_activations_ppl import compare  # noqa: E402

from folio import LLM  # noqa: E402
from folio.kernels import native  # noqa: E402
from folio.model.loader import resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def requantized(folder: Path) -> Path:
    out = folder / "smollm2-135m-Q4_K_M.gguf"
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tool = ROOT / "build" / "llama.cpp" / "native" / "bin" / "llama-quantize"
        subprocess.run([str(tool), "--allow-requantize", resolve_model_path(None)[0], str(out),
                        "Q4_K_M"], check=True, capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/kq")
    args = ap.parse_args()
    path = str(requantized(Path(args.dir)))
    per32 = native._build(("-DFOLIO_QL_SUPER=0",))
    default = native.load()

    def run(activations, lib):
        def make():
            native._lib = lib           # the library every kernel call of the run takes
            return LLM(path, dtype="float32", max_model_len=2048,
                       activation_quantization=activations)
        return make
    try:
        compare([("none (fp32 arithmetic)", run("none", default)),
                 ("int8, x per 32 inputs", run("int8", per32)),
                 ("int8, x per super-block (the default)", run("int8", default))])
    finally:
        native._lib = default


if __name__ == "__main__":
    main()
