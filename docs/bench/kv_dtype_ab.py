"""A float32 run's KV cache in float32 (the default) against bfloat16
(`--kv-cache-dtype bfloat16`), side by side in one process: the blocks a fixed
`--kv-cache-memory-bytes` holds with each, and one request's output tok/s at a
short and a long context (greedy, EOS ignored, 2 threads), the two engines
alternated round by round so both see the same minutes of a drifting VM.

    .venv/bin/python docs/bench/kv_dtype_ab.py [--rounds 3] [--contexts 256:256,2048:256]
    # as an AVX2-only CPU runs it (fp32 is then the default dtype):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/bench/kv_dtype_ab.py --avx2-sim
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contexts", default="256:256,2048:256",
                   help="prompt:output token counts, comma-separated")
    p.add_argument("--memory", default="256MiB", help="--kv-cache-memory-bytes of both")
    p.add_argument("--avx2-sim", action="store_true", help="scripts/avx2_sim.py first")
    args = p.parse_args()
    if args.avx2_sim:
        sys.path.insert(0, str(ROOT / "scripts"))
        import avx2_sim
        avx2_sim.apply()
    import torch
    from folio import LLM, SamplingParams
    torch.set_num_threads(2)
    contexts = [tuple(int(n) for n in c.split(":")) for c in args.contexts.split(",")]
    longest = max(p + o for p, o in contexts)
    engines = {kv: LLM(dtype="float32", kv_cache_dtype=kv, kv_cache_memory_bytes=args.memory,
                       max_model_len=max(2048, longest))
               for kv in ("float32", "bfloat16")}
    for kv, llm in engines.items():
        cfg = llm.engine.config
        print(json.dumps({"kv_cache_dtype": kv, "memory": args.memory,
                          "blocks": llm.engine.num_blocks,
                          "tokens": llm.engine.num_blocks * cfg.cache.block_size}), flush=True)
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    rates: dict[tuple, list[float]] = {}
    for llm in engines.values():
        llm.generate([{"prompt_token_ids": list(range(1000, 1064))}], warm)
    for r in range(args.rounds):
        for prompt_len, output_len in contexts:
            prompt = {"prompt_token_ids": [1000 + i % 40000 for i in range(prompt_len)]}
            params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
            for kv, llm in engines.items():
                start = time.perf_counter()
                llm.generate([prompt], params)
                rate = output_len / (time.perf_counter() - start)
                rates.setdefault((prompt_len, output_len, kv), []).append(rate)
                print(json.dumps({"round": r + 1, "prompt": prompt_len, "output": output_len,
                                  "kv_cache_dtype": kv, "tok/s": round(rate, 1)}), flush=True)
    for prompt_len, output_len in contexts:
        f32 = statistics.median(rates[(prompt_len, output_len, "float32")])
        b16 = statistics.median(rates[(prompt_len, output_len, "bfloat16")])
        print(json.dumps({"prompt": prompt_len, "output": output_len,
                          "median tok/s float32": round(f32, 1),
                          "median tok/s bfloat16": round(b16, 1),
                          "bfloat16 / float32": round(b16 / f32, 3)}), flush=True)


if __name__ == "__main__":
    main()
