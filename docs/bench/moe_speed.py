"""A mixture of experts of realistic proportions, served: Folio beside
llama.cpp's llama-server on the same GGUF, and Folio's fused MoE layer beside
the per-token loop, in one run.

The model: a random Qwen3-MoE (hidden 768, 12 layers, 12 heads of 64, 4 KV
heads, 16 experts of 512 features, top-2, renormalized), saved by
transformers and written as an F16 GGUF by tests/utils.py's write_tiny_gguf
(llama.cpp's converter's layout; both sides then read 2 bytes a weight).
Folio runs its experts in bf16 where the CPU has AVX512-BF16, else fp32,
and with `-q int4` in 4-bit codes (requantized from the file's values);
llama.cpp on the F16 file. Then Folio and llama.cpp on Q4_0 and Q4_K_M copies
llama.cpp's own llama-quantize makes (Folio keeps their experts in the
files' codes), with the bytes Folio holds (`folio bench weights`).
`--before DIR`: both Folio rows of the F16 file from an earlier checkout too;
`--quantized-only`: the copies' rows alone.
Workloads and the driver are cpu_baselines.py's (`folio bench serve`,
token-id prompts, EOS ignored). The layer part times one MoE layer's
experts on T tokens: the fused path (tokens grouped by expert, each chosen
expert's weights read once) against the per-token loop (each token reads
its k experts), with the bytes of expert weights each reads.

    .venv/bin/python docs/bench/moe_speed.py [--rounds N] [--save FILE] [--keep DIR]
        [--llama-isa native|avx2|avx512] [--before DIR] [--quantized-only]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_baselines import (ROOT, before_cmd, before_env, env_for, folio_cmd,  # noqa: E402
                           free_port, llama_cpp_rows, model_bench_main, prompts_of,
                           random_gguf, serve)

SHAPE = dict(arch="qwen3_moe", dialect="v5", hidden_size=768, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=16,
             num_experts_per_tok=2, moe_intermediate_size=512, norm_topk_prob=True,
             max_position_embeddings=4096)


def make_model(folder: Path) -> Path:
    return random_gguf(folder, SHAPE, "F16", "qwen3moe-f16.gguf")


def layer_times() -> dict:
    """ms per call of one layer's experts, fused and per token, and the MB of
    expert weights each reads, at 1, 8 and 64 tokens (bf16 where the CPU has it)."""
    import torch

    from folio.model.layers.moe import fused_experts, reference_experts, route
    from folio.worker.device import resolve_dtype, torch_dtype
    torch.manual_seed(0)
    dtype = torch_dtype(resolve_dtype("auto", "cpu"))
    e, i, h, k = SHAPE["num_experts"], SHAPE["moe_intermediate_size"], SHAPE["hidden_size"], \
        SHAPE["num_experts_per_tok"]
    w13 = (torch.randn(e, 2 * i, h) * 0.05).to(dtype)
    w2 = (torch.randn(e, h, i) * 0.05).to(dtype)
    router = torch.randn(e, h) * 0.05
    per_expert = 3 * i * h * w13.element_size()
    out = {"dtype": str(dtype).removeprefix("torch.")}
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, h).to(dtype)
        weights, ids = route(x.float() @ router.t(), k, True, False)
        chosen = len(set(ids.reshape(-1).tolist()))
        for name, fn in (("fused", fused_experts), ("per token", reference_experts)):
            fn(x, w13, w2, weights, ids)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 1.0:
                fn(x, w13, w2, weights, ids)
                n += 1
            reads = chosen if name == "fused" else tokens * k
            out[f"{name}, {tokens} tokens"] = {
                "ms": (time.perf_counter() - start) / n * 1e3,
                "expert MB read": reads * per_expert / 1e6,
                "experts chosen": chosen}
            print(f"  {name}, {tokens} tokens: {out[f'{name}, {tokens} tokens']}", flush=True)
    return out


COPIES = ("Q4_0", "Q4_K_M")


def quantized_copy(args, model: Path, kind: str):
    """The model quantized to `kind` by llama.cpp's own llama-quantize (the
    build's, beside its server), once; None where it is not built."""
    quantize = ROOT / "build" / "llama.cpp" / args.llama_isa / "bin" / "llama-quantize"
    out = model.with_name(model.stem.replace("-f16", "") + f"-{kind.lower()}.gguf")
    if not out.exists() and quantize.exists():
        subprocess.run([str(quantize), str(model), str(out), kind], check=True,
                       capture_output=True)
    return out if out.exists() else None


def held_mb(args, model: Path) -> float:
    """The MB of weights Folio holds for `model` (`folio bench weights`)."""
    report = subprocess.run([*folio_cmd(args), "bench", "weights", "--json", "--model",
                             str(model), "--num-kv-blocks", "64"], capture_output=True,
                            text=True, check=True, env=env_for(args))
    return json.loads(report.stdout.strip().splitlines()[-1])["loaded"]["bytes"]["total"] / 1e6


def one_round(args, tmp: Path) -> dict:
    model = make_model(args.keep or tmp / "model")
    prompts_of(model)
    rows: dict = {}
    systems = {"folio (experts in the run dtype)": [],
               "folio -q int4 (every linear layer and expert in 4-bit codes)": ["-q", "int4"]}
    for name, flags in ({} if args.quantized_only else systems).items():
        if args.before:
            port = free_port()
            rows[f"{name}, before"] = serve(
                args, f"{name}, before", [*before_cmd(args), "serve", "--model", str(model),
                                          *flags, "--port", str(port)],
                port, tmp / f"folio-before-{len(rows)}.log", env=before_env(args))
        port = free_port()
        rows[name] = serve(args, name, [*folio_cmd(args), "serve", "--model", str(model),
                                        *flags, "--port", str(port)],
                           port, tmp / f"folio-{len(rows)}.log")
    if not args.quantized_only:
        rows.update(llama_cpp_rows(args, model, tmp))
    for kind in COPIES:
        copy = quantized_copy(args, model, kind)
        if copy is None:
            continue
        size = f"{kind}: file {copy.stat().st_size / 1e6:.1f} MB, Folio holds " \
               f"{held_mb(args, copy):.1f} MB"
        print(f"  {size}", flush=True)
        rows[f"({size})"] = {}
        port = free_port()
        name = f"folio on the {kind} file (experts in its codes)"
        rows[name] = serve(args, name, [*folio_cmd(args), "serve", "--model", str(copy),
                                        "--port", str(port)], port, tmp / f"folio-{kind}.log")
        rows.update(llama_cpp_rows(args, copy, tmp, f" on the {kind} file"))
    if not args.quantized_only:
        print("  the layer's experts:", flush=True)
        layer = layer_times()
        rows[f"(layer timings: {layer})"] = {}
    return rows


def main() -> None:
    model_bench_main(__doc__, one_round, extra=lambda p: p.add_argument(
        "--quantized-only", action="store_true", help="only the quantized copies' rows"))


if __name__ == "__main__":
    sys.exit(main())
