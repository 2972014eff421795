"""Multi-LoRA throughput (issue 31) on the default model, offline (`LLM`),
in one run, configurations alternating within each round: the standard
workload (32 requests at once, prompts 32-384 and outputs 32-192 random ids,
greedy, EOS ignored) with no adapter (LoRA off), with LoRA on and no
adapter, with one adapter for all 32, and with the 32 spread over 8
adapters (max_loras 8). Adapters are rank 16 on every projection (q/k/v/o,
gate/up/down), random, written in PEFT's layout by this script (their
values do not change the work). Prints output tok/s, each configuration's
ratio to the base, and each adapter's memory as computed.

    .venv/bin/python docs/bench/lora.py [--rounds 2] [--rank 16] [--adapters 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for a Llama-shaped ModelConfig."""
    import torch
    from safetensors.torch import save_file

    from folio.model.lora.checkpoint import projection_shapes
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for leaf, (out, inp) in projection_shapes(cfg).items():
            block = "self_attn" if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{leaf}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": list(projection_shapes(cfg))}))


def run(standard, loras, **engine) -> float:
    from folio import LLM, SamplingParams
    llm = LLM(max_model_len=2048, **engine)
    warm = [{"prompt_token_ids": r.prompt_token_ids} for r in standard[:2]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                 lora_request=loras[:2] if loras else None)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in standard],
                        [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
                         for r in standard], use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - t0
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    args = p.parse_args()
    from folio.bench.datasets import random_requests
    from folio.env_report import cpu_info
    from folio.lora_request import LoRARequest
    from folio.model.loader import load_model_config
    from folio.model.lora.checkpoint import projection_shapes
    model, flags = cpu_info()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    print(f"{datetime.now(timezone.utc).isoformat(timespec='minutes')} | {model}; flags: "
          f"{' '.join(f for f in wanted if f in flags)}")
    cfg = load_model_config(None)
    standard = random_requests(32, (32, 384), (32, 192), cfg.vocab_size, [0, 1, 2], 0)
    root = Path(tempfile.mkdtemp())
    adapters = []
    for i in range(args.adapters):
        write_adapter(root / f"a{i}", cfg, args.rank, i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    per = args.rank * sum(o + i for o, i in projection_shapes(cfg).values()) * \
        cfg.num_hidden_layers
    print(f"an adapter of rank {args.rank} on every projection: {per / 1e6:.2f}M parameters, "
          f"{per * 4 / 2**20:.1f} MiB as fp32 (the slots hold them in the run dtype, "
          f"rank padded to max_lora_rank)")
    n = len(standard)
    configs = {
        "base, LoRA off": ({}, None),
        "LoRA on, no adapter": ({"enable_lora": True, "max_lora_rank": args.rank}, None),
        "one adapter": ({"enable_lora": True, "max_lora_rank": args.rank}, [adapters[0]] * n),
        f"{args.adapters} adapters": ({"enable_lora": True, "max_lora_rank": args.rank,
                                       "max_loras": args.adapters},
                                      [adapters[i % args.adapters] for i in range(n)]),
    }
    results = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (engine, loras) in configs.items():
            results[name].append(run(standard, loras, **engine))
            print(f"round {r + 1} {name}: {results[name][-1]:.1f} tok/s", flush=True)
    base = results["base, LoRA off"]
    print("\n| configuration | " + " | ".join(f"round {r + 1}, tok/s" for r in range(args.rounds))
          + " | time against the base |")
    print("|---|" + "---|" * (args.rounds + 1))
    for name, runs in results.items():
        ratio = " / ".join(f"{b / x:.2f}x" for b, x in zip(base, runs))
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in runs) + f" | {ratio} |")


if __name__ == "__main__":
    main()
