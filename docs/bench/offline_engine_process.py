"""Offline `LLM.generate` with the engine in the caller's thread (the default)
against `LLM(engine_process=True)` (the engine core in a process of its own,
the text and the outputs made in this one), alternated round by round, on
the negligible model of `folio bench host` (random Llama, hidden 64, 2
layers, 4,096-token vocabulary, float32): 256 requests of 4 prompt and 512
output tokens, EOS ignored, one engine thread (OMP_NUM_THREADS=1), nothing
placed. Output tokens per second, the best of 2 runs after a warm-up.

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/offline_engine_process.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src" / "folio" / "bench"))
import host  # noqa: E402

N, PROMPT, OUTPUT = 256, 4, 512


def rate(model: str, engine_process: bool) -> float:
    from folio import LLM, SamplingParams
    llm = LLM(model, dtype="float32", device="cpu", max_num_seqs=N,
              max_num_batched_tokens=2048,
              num_kv_blocks=N * ((PROMPT + OUTPUT) // 16 + 2) + 64,
              engine_process=engine_process)
    rng, runs = random.Random(0), []
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    try:
        for _ in range(3):              # the first warms up
            prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(PROMPT)]}
                       for _ in range(N)]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            runs.append(N * OUTPUT / (time.perf_counter() - t0))
    finally:
        llm.shutdown()
    return max(runs[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rates: dict = {"engine in this thread": [], "engine_process=True": []}
    with tempfile.TemporaryDirectory(prefix="folio-offline-") as tmp:
        model = host.make_model(Path(tmp) / "model")
        for r in range(args.rounds):
            for side in rates:
                rates[side].append(rate(model, side == "engine_process=True"))
                print(f"round {r + 1}, {side}: {rates[side][-1]:.0f} output tok/s", flush=True)
    print(f"\n{host._cpu()}; {N} requests of {PROMPT} prompt and {OUTPUT} output tokens\n")
    print("| offline LLM | output tok/s, each round |")
    print("|---|---|")
    for side, r in rates.items():
        print(f"| {side} | {', '.join(f'{x:.0f}' for x in r)} |")
    print("\n" + json.dumps(rates))


if __name__ == "__main__":
    main()
