"""A Q4_K_M GGUF, the file most people download: Folio on its codes beside
Folio on its dequantized weights (what Folio did before it kept K-quants
packed) and llama.cpp's llama-server on the same file, served, in one run.

The model: a random Llama of a small real model's proportions with every
row whole K-quant super-blocks (hidden 1024, intermediate 2816, 24 layers,
16 heads of 64, 8 KV heads; its vocabulary is the test tokenizer's 384, so
the LM head costs nearly nothing on either side), written as an F32 GGUF by
tests/utils.py's write_tiny_gguf and quantized to Q4_K_M by llama.cpp's own
llama-quantize (scripts/install_llama_cpp.sh builds both). Workloads and the
driver are cpu_baselines.py's (`folio bench serve`, token-id prompts, EOS
ignored): one request, 256 in / 256 out; and 32 requests at once. Also the
file's size, the bytes Folio holds (`folio bench weights`) and the machine's
memory bandwidth. `--before DIR`: the codes' row (and the bytes held) from an
earlier checkout too.

    .venv/bin/python docs/bench/kquant_speed.py [--rounds N] [--save FILE] [--keep DIR]
        [--llama-isa native|avx2|avx512] [--before DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_baselines import (ROOT, before_cmd, before_env, env_for, folio_cmd,  # noqa: E402
                           free_port,
                           llama_cpp_rows, model_bench_main, prompts_of, random_gguf,
                           serve)

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)


def make_model(folder: Path, isa: str) -> Path:
    out = folder / "llama-q4_k_m.gguf"
    if not out.exists():
        f32 = random_gguf(folder, {"arch": "llama", **SHAPE}, "F32", "f32.gguf")
        quantize = ROOT / "build" / "llama.cpp" / isa / "bin" / "llama-quantize"
        subprocess.run([str(quantize), str(f32), str(out), "Q4_K_M"], check=True,
                       capture_output=True)
        f32.unlink()
    return out


def one_round(args, tmp: Path) -> dict:
    model = make_model(args.keep or tmp / "model", args.llama_isa)
    prompts_of(model)
    rows: dict = {}
    folios = {"": (folio_cmd(args), env_for(args))}
    if args.before:
        folios[", before"] = (before_cmd(args), before_env(args))
    for which, (cmd, env) in folios.items():
        weights = subprocess.run([*cmd, "bench", "weights", "--json", "--model", str(model),
                                  "--num-kv-blocks", "64"], capture_output=True, text=True,
                                 check=True, env=env)
        held = json.loads(weights.stdout.strip().splitlines()[-1])["loaded"]["bytes"]["total"]
        size = f"file {model.stat().st_size / 1e6:.1f} MB, Folio{which} holds {held / 1e6:.1f} MB"
        rows[f"({size})"] = {}
        print(f"  {size}", flush=True)
    if args.before:
        port = free_port()
        rows["folio, Q4_K_M codes, before"] = serve(
            args, "folio, before", [*before_cmd(args), "serve", "--model", str(model),
                                    "--dtype", "float32", "--port", str(port)],
            port, tmp / "folio-before.log", env=before_env(args))
    for name, flags in {"folio, Q4_K_M codes (default)": ["--dtype", "float32"],
                        "folio -q none (dequantized, as before)": ["--dtype", "bfloat16",
                                                                    "-q", "none"]}.items():
        port = free_port()
        rows[name] = serve(args, name, [*folio_cmd(args), "serve", "--model", str(model),
                                        *flags, "--port", str(port)],
                           port, tmp / f"folio-{len(rows)}.log")
    rows.update(llama_cpp_rows(args, model, tmp))
    return rows


def main() -> None:
    model_bench_main(__doc__, one_round)


if __name__ == "__main__":
    sys.exit(main())
