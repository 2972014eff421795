"""Quantized formats beside the float paths and llama.cpp, in one run (issue 16).

The two workloads of docs/bench/cpu_baselines.py (standard: 32 requests,
prompt 32-384, output 32-192 tokens; one request: 256 in, 256 out, two
requests one after the other), each against one server at a time, 2 threads:

- Folio on the default GGUF (SmolLM2-135M-Instruct, Q4_1 linear layers and a
  Q8_0 embedding): its own 4-bit codes, and `--quantization none` (everything
  dequantized to float at load, the path before issue 16), each in float32
  and bfloat16;
- Folio with `--quantization int8` and `--quantization fp8` (round to
  nearest at load: int8 codes, e4m3 ones) on the same weights dequantized
  and written as a Hugging Face folder, float32 and bfloat16;
- Folio on the GPTQ 4-bit g128 and AWQ 4-bit g64 checkpoints of the same
  model (AWQ cannot make groups of 128 on its 576 inputs), where
  scripts/make_smollm_quant.sh has made them (build/quant-smollm/), bfloat16;
- llama.cpp's llama-server on the same GGUF file (16 slots, 2 threads), built
  by scripts/install_llama_cpp.sh.

    .venv/bin/python docs/bench/quant_speed.py [--avx2-sim] [--rounds N] [--save FILE]
                                               [--only SUBSTRING,...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_baselines as cb  # noqa: E402

QUANT = cb.ROOT / "build" / "quant-smollm"


def wanted(args, row: str) -> bool:
    return not args.only or any(s in row for s in args.only.split(","))


def folio(args, tmp: Path, name: str, *flags: str) -> dict:
    port = cb.free_port()
    return cb.serve(args, name, [*cb.folio_cmd(args), "serve", *flags, "--port", str(port)],
                    port, tmp / f"{name.replace(' ', '_')}.log")


def one_round(args, tmp: Path) -> dict:
    rows: dict = {}
    dense = cb.dense_folder(tmp)
    for dtype in ("float32", "bfloat16"):
        runs = {f"folio GGUF Q4_1 codes, {dtype}": ("--dtype", dtype),
                f"folio dequantized (-q none), {dtype}": ("--dtype", dtype, "--quantization",
                                                          "none"),
                f"folio int8 at load, {dtype}": (str(dense), "--dtype", dtype,
                                                 "--quantization", "int8"),
                f"folio fp8 at load, {dtype}": (str(dense), "--dtype", dtype,
                                                "--quantization", "fp8")}
        for row, flags in runs.items():
            if wanted(args, row):
                rows[row] = folio(args, tmp, row.removeprefix("folio "), *flags)
    for fmt in ("gptq-w4-g128", "awq-w4-g64"):
        folder, row = QUANT / fmt, f"folio {fmt}, bfloat16"
        if not wanted(args, row):
            continue
        if folder.is_dir():
            rows[row] = folio(args, tmp, f"{fmt} bfloat16", str(folder), "--dtype", "bfloat16")
        else:
            print(f"  no {folder}: run scripts/make_smollm_quant.sh first", flush=True)
    if wanted(args, "llama.cpp (same GGUF)"):
        llama = cb.llama_cpp_row(args, tmp)
        if llama is not None:
            rows["llama.cpp (same GGUF)"] = llama
    return rows


def main() -> None:
    p = cb.bench_parser(__doc__)
    p.add_argument("--only", default="", help="comma-separated substrings of the rows to run")
    cb.run_rounds(p.parse_args(), one_round)

if __name__ == "__main__":
    sys.exit(main())
