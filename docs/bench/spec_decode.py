"""Speculative decoding with n-gram proposals (issue 30), on the default model
with its default settings, offline (`LLM`), greedy, in one run, rounds
alternating between the configurations:

- copying, one request at a time: chat prompts whose answers copy or edit a
  given text (public-domain prose, and a passage of code), up to 256 tokens
  each, EOS ends them; greedy, and sampled at temperature 0.7;
- random ids, one request at a time: 256 random prompt ids, 256 output tokens
  (EOS ignored), two requests;
- standard: 32 requests at once, prompts 32-384 and outputs 32-192 random ids
  (cpu_baselines.py's standard workload, offline), greedy, and sampled at
  temperature 1 (where the model rarely repeats what came before).

For each: output tok/s without and with proposals, their ratio, and the
acceptance rate (accepted over proposed tokens) and mean accepted length
(tokens a step with proposals yields per sequence).

With --served, the copying prompts are also sent one at a time to `folio
serve` without and with proposals, through `folio bench serve` (chat
endpoint, streaming), each server alone on the machine.

    .venv/bin/python docs/bench/spec_decode.py [--rounds N] [--k 4] [--save FILE] [--served]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import datetime, timezone

from folio.bench.texts import ALICE, AUSTEN

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
COPYING = [
    [{"role": "user", "content": "Repeat this passage exactly:\n\n" + ALICE}],
    [{"role": "user", "content": "Repeat this passage exactly:\n\n" + AUSTEN}],
    [{"role": "user", "content": "Rewrite this Python function with the name `rolling_mean` "
                                 "instead of `moving_average`, changing nothing else:\n\n" + CODE}],
]


def _counters(llm):
    return llm.engine.scheduler.spec_counts


def _acceptance(before, after) -> dict:
    run = after.since(before)
    return {"proposed": run.draft_tokens, "accepted": run.accepted_tokens,
            "acceptance_rate": run.acceptance_rate,
            "mean_accepted_length": run.mean_accepted_length}


def run_config(spec, standard, random_ids) -> dict:
    from folio import LLM, SamplingParams
    from folio.bench.throughput import run_engine
    llm = LLM(max_model_len=2048, speculative_config=spec)
    llm.generate([{"prompt_token_ids": [1] * 16}],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    out = {}
    # copying, one at a time
    c0, t0, tokens = _counters(llm), time.perf_counter(), 0
    params = SamplingParams(temperature=0, max_tokens=256)
    texts = []
    for chat in COPYING:
        o = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
        tokens += len(o.token_ids)
        texts.append(o.token_ids)
    seconds = time.perf_counter() - t0
    out["copying"] = {"output_tokens": tokens, "seconds": seconds,
                      "tok_s": tokens / seconds, **_acceptance(c0, _counters(llm)),
                      "tokens": texts}
    # copying, sampled (temperature 0.7; no seed of its own, since a seeded
    # request takes no proposals: each engine's seed draws the same), one at a time
    c0, t0, tokens = _counters(llm), time.perf_counter(), 0
    for chat in COPYING:
        o = llm.chat(chat, SamplingParams(temperature=0.7, max_tokens=256),
                     use_tqdm=False)[0].outputs[0]
        tokens += len(o.token_ids)
    seconds = time.perf_counter() - t0
    out["copying, T=0.7"] = {"output_tokens": tokens, "seconds": seconds,
                             "tok_s": tokens / seconds, **_acceptance(c0, _counters(llm))}
    # random ids, one at a time
    c0, t0, tokens = _counters(llm), time.perf_counter(), 0
    for ids in random_ids:
        o = llm.generate([{"prompt_token_ids": ids}],
                         SamplingParams(temperature=0, max_tokens=256, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        tokens += len(o.token_ids)
    seconds = time.perf_counter() - t0
    out["random ids"] = {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                         **_acceptance(c0, _counters(llm))}
    # standard: 32 at once
    c0 = _counters(llm)
    produced, seconds = run_engine(llm.engine, standard, True, "continuous", 0)
    out["standard"] = {"output_tokens": sum(produced), "seconds": seconds,
                       "tok_s": sum(produced) / seconds, **_acceptance(c0, _counters(llm))}
    # standard, sampled at temperature 1 (the low-acceptance case)
    c0, t0 = _counters(llm), time.perf_counter()
    for i, r in enumerate(standard):
        llm.engine.add_tokenized_request(f"t1-{i}", None, r.prompt_token_ids, SamplingParams(
            temperature=1.0, max_tokens=r.max_tokens, ignore_eos=True))
    tokens = 0
    while llm.engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in llm.engine.step() if o.finished)
    seconds = time.perf_counter() - t0
    out["standard, T=1"] = {"output_tokens": tokens, "seconds": seconds,
                            "tok_s": tokens / seconds, **_acceptance(c0, _counters(llm))}
    llm.shutdown()
    return out


def served(spec, rounds: int) -> list[dict]:
    """`folio bench serve` on the copying prompts, one at a time, against a
    `folio serve` started with `spec` (None: without proposals)."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_baselines import free_port, wait_up
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "folio.cli", "serve", "--port", str(port),
           "--max-model-len", "2048"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "copying.jsonl"
        data.write_text("".join(json.dumps({"prompt": c[0]["content"], "max_tokens": 256})
                                + "\n" for c in COPYING))
        with open(Path(tmp) / "server.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ))
            try:
                wait_up(url, proc, 600)
                runs = []
                for _ in range(rounds + 1):         # the first warms up
                    done = subprocess.run(
                        [sys.executable, "-m", "folio.cli", "bench", "serve", "--base-url", url,
                         "--endpoint", "/v1/chat/completions", "--dataset", str(data),
                         "--num-prompts", str(len(COPYING)), "--max-concurrency", "1",
                         "--json"], capture_output=True, text=True, check=True)
                    runs.append(json.loads(done.stdout.strip().splitlines()[-1])["runs"][0])
                return runs[1:]
            finally:
                proc.terminate()
                proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--save", default=None, metavar="FILE")
    p.add_argument("--served", action="store_true",
                   help="also the copying prompts served, one at a time")
    args = p.parse_args()
    from folio.bench.datasets import random_requests
    from folio.env_report import cpu_info
    model, flags = cpu_info()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    print(f"{datetime.now(timezone.utc).isoformat(timespec='minutes')} | {model}; flags: "
          f"{' '.join(f for f in wanted if f in flags)}")
    vocab = 49152
    standard = random_requests(32, (32, 384), (32, 192), vocab, [0, 1, 2], 0)
    rng = random.Random(1)
    random_ids = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(2)]
    configs = {"off": None,
               f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    results: dict = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, spec in configs.items():
            res = run_config(spec, standard, random_ids)
            results[name].append(res)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{w} {v['tok_s']:.1f} tok/s" for w, v in res.items()), flush=True)
    on = f"ngram k={args.k}"
    same = [sum(x == y for x, y in zip(a["copying"]["tokens"], b["copying"]["tokens"]))
            for a, b in zip(results["off"], results[on])]
    print(f"\ngreedy copying outputs identical with and without proposals, per round: "
          f"{same} of {len(COPYING)}\n")
    print("| workload | round | off, tok/s | ngram, tok/s | ratio | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|")
    for w in ("copying", "copying, T=0.7", "random ids", "standard", "standard, T=1"):
        for r in range(args.rounds):
            a, b = results["off"][r][w], results[on][r][w]
            rate = "-" if b["acceptance_rate"] is None else f"{100 * b['acceptance_rate']:.0f}%"
            length = "-" if b["mean_accepted_length"] is None else \
                f"{b['mean_accepted_length']:.2f}"
            print(f"| {w} | {r + 1} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
                  f"{b['tok_s'] / a['tok_s']:.2f}x | {rate} ({b['accepted']} of "
                  f"{b['proposed']}) | {length} |")
    if args.served:
        serve_runs = {name: served(spec, args.rounds) for name, spec in configs.items()}
        results["served"] = serve_runs
        print("\n| served, copying one at a time | round | off, out tok/s | ngram, out tok/s "
              "| ratio | TPOT median off / ngram, ms |")
        print("|---|---|---|---|---|---|")
        for r in range(args.rounds):
            a, b = serve_runs["off"][r], serve_runs[on][r]
            print(f"| | {r + 1} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                  f"{b['output_throughput'] / a['output_throughput']:.2f}x | "
                  f"{a['tpot_ms']['median']:.1f} / {b['tpot_ms']['median']:.1f} |")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
