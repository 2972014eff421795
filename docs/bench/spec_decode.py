"""Speculative decoding (issue 30) on the default model, offline (`LLM`), in
one run, rounds alternating between the configurations: the default model
with its default settings (the GGUF's Q4_1 codes) without and with n-gram
proposals; and with --draft, its weights dequantized to float (`-q none
--dtype bfloat16`) without and with the same file's Q4_1 codes as a draft
model (the 4-bit self-draft). Workloads:

- copying, one request at a time: chat prompts whose answers copy or edit a
  given text (public-domain prose, and a passage of code), up to 256 tokens
  each, EOS ends them; greedy, and sampled at temperature 0.7;
- random ids, one request at a time: 256 random prompt ids, 256 output tokens
  (EOS ignored), two requests;
- standard: 32 requests at once, prompts 32-384 and outputs 32-192 random ids
  (cpu_baselines.py's standard workload, offline), greedy, and sampled at
  temperature 1 (where the model rarely repeats what came before).

For each pair: output tok/s without and with proposals, their ratio, and the
acceptance rate (accepted over proposed tokens) and mean accepted length
(tokens a step with proposals yields per sequence).

With --served, the copying prompts are also sent one at a time to `folio
serve` without and with proposals, through `folio bench serve` (chat
endpoint, streaming), each server alone on the machine.

    .venv/bin/python docs/bench/spec_decode.py [--rounds N] [--k 4] [--save FILE] [--served]
                                               [--draft] [--draft-k 4] [--llama-cpp]
                                               [--sweep 1,2,4,8,16] [--only-standard]
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


def run_config(spec, standard, random_ids, only_standard=False, **engine) -> dict:
    from folio import LLM, SamplingParams
    llm = LLM(max_model_len=2048, speculative_config=spec, **engine)
    llm.generate([{"prompt_token_ids": [1] * 16}],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    out = {} if only_standard else one_at_a_time(llm, random_ids)
    out.update(at_once(llm, standard))
    llm.shutdown()
    return out


def one_at_a_time(llm, random_ids) -> dict:
    from folio import SamplingParams
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
    return out


def at_once(llm, standard) -> dict:
    from folio import SamplingParams
    from folio.bench.throughput import run_engine
    out = {}
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


def beside_llama_cpp(rounds: int, k: int) -> dict:
    """One request at a time, the copying prompts as token ids (the chat
    template applied by Folio), 256 output tokens each, EOS ignored, greedy:
    Folio offline and llama-server (`/completion`, 2 threads), each without
    and with a draft: the float model (Folio bf16 from the GGUF, llama.cpp an
    F16 GGUF that llama-quantize makes from the same file) drafted for by
    the file's own Q4_1 codes, num_speculative_tokens = --spec-draft-n-max
    = k (llama-server loads a --spec-draft-model but drafts with it only
    under --spec-type draft-simple)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from folio import LLM, SamplingParams
    from folio.bench.llama_cpp import LlamaServer, find_llama_server
    from folio.model.loader import resolve_model_path
    gguf, _ = resolve_model_path(None)
    server = find_llama_server()
    f16 = Path(tempfile.mkdtemp()) / "f16.gguf"
    subprocess.run([str(Path(server).with_name("llama-quantize")), "--allow-requantize", gguf,
                    str(f16), "F16"], check=True, capture_output=True)
    probe = LLM(max_model_len=2048)
    tok = probe.engine.tokenizer
    prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in COPYING]
    probe.shutdown()
    draft = {"method": "draft_model", "model": gguf, "num_speculative_tokens": k}
    folio_configs = {"Folio, Q4_1 codes": ({}, None),
                     "Folio, float (bf16)": ({"quantization": "none", "dtype": "bfloat16"}, None),
                     "Folio, float + Q4_1 self-draft": (
                         {"quantization": "none", "dtype": "bfloat16"}, draft)}
    llama_configs = {"llama.cpp, Q4_1": (gguf, ()),
                     "llama.cpp, F16": (str(f16), ()),
                     "llama.cpp, F16 + Q4_1 draft": (str(f16), (
                         "--spec-draft-model", gguf, "--spec-draft-n-max", str(k),
                         "--spec-type", "draft-simple"))}
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    results: dict = {name: [] for name in [*folio_configs, *llama_configs]}
    for _ in range(rounds):
        for name, (engine, spec) in folio_configs.items():
            llm = LLM(max_model_len=2048, speculative_config=spec, **engine)
            llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            c0, t0, tokens = _counters(llm), time.perf_counter(), 0
            for ids in prompts:
                tokens += len(llm.generate([{"prompt_token_ids": ids}], params,
                                           use_tqdm=False)[0].outputs[0].token_ids)
            seconds = time.perf_counter() - t0
            results[name].append({"tok_s": tokens / seconds, **_acceptance(c0, _counters(llm))})
            llm.shutdown()
        for name, (model, extra) in llama_configs.items():
            with LlamaServer(server, model, 1, 2048, 2, extra_args=extra) as ls:
                ls.complete(prompts[0], 8)
                t0, tokens, drafted, accepted = time.perf_counter(), 0, 0, 0
                for ids in prompts:
                    out: dict = {}
                    tokens += ls.complete(ids, 256, result=out)
                    timings = out.get("timings", {})
                    drafted += timings.get("draft_n", 0)
                    accepted += timings.get("draft_n_accepted", 0)
                seconds = time.perf_counter() - t0
            results[name].append({"tok_s": tokens / seconds, "proposed": drafted,
                                  "accepted": accepted,
                                  "acceptance_rate": accepted / drafted if drafted else None})
        print("round: " + ", ".join(f"{n} {v[-1]['tok_s']:.1f}" for n, v in results.items()),
              flush=True)
    print("\n| one request, copying prompts, 256 tokens | " +
          " | ".join(f"round {r + 1}, tok/s" for r in range(rounds)) + " | accepted of proposed |")
    print("|---|" + "---|" * (rounds + 1))
    for name, runs in results.items():
        last = runs[-1]
        acc = "-" if not last.get("proposed") else \
            f"{100 * last['accepted'] / last['proposed']:.0f}% ({last['accepted']} of " \
            f"{last['proposed']})"
        print(f"| {name} | " + " | ".join(f"{r['tok_s']:.1f}" for r in runs) + f" | {acc} |")
    return results


def batch_sweep(configs: dict, pairs: list, standard, sizes, rounds: int) -> dict:
    """Where proposals stop paying: the first N requests of the standard
    workload at once (greedy), for each N, without and with proposals."""
    from folio import LLM
    from folio.bench.throughput import run_engine
    results: dict = {name: {n: [] for n in sizes} for name in configs}
    for _ in range(rounds):
        for name, (engine, spec) in configs.items():
            llm = LLM(max_model_len=2048, speculative_config=spec, **engine)
            run_engine(llm.engine, standard[:2], True, "continuous", 0)      # warm-up
            for n in sizes:
                produced, seconds = run_engine(llm.engine, standard[:n], True, "continuous", 0)
                results[name][n].append(sum(produced) / seconds)
            llm.shutdown()
    for off, on in pairs:
        print(f"\n| requests at once | {off}, tok/s | {on}, tok/s | ratio (per round) |")
        print("|---|---|---|---|")
        for n in sizes:
            a, b = results[off][n], results[on][n]
            print(f"| {n} | {' / '.join(f'{x:.1f}' for x in a)} | "
                  f"{' / '.join(f'{x:.1f}' for x in b)} | "
                  f"{' / '.join(f'{y / x:.2f}x' for x, y in zip(a, b))} |")
    return results


def _table(results: dict, off: str, on: str, rounds: int, workloads: list[str]) -> None:
    if "copying" in workloads:
        same = [sum(x == y for x, y in zip(a["copying"]["tokens"], b["copying"]["tokens"]))
                for a, b in zip(results[off], results[on])]
        print(f"\n{on} against {off}: greedy copying outputs identical, per round: "
              f"{same} of {len(COPYING)}")
    print()
    print(f"| workload | round | {off}, tok/s | {on}, tok/s | ratio | acceptance | "
          "mean accepted length |")
    print("|---|---|---|---|---|---|---|")
    for w in workloads:
        for r in range(rounds):
            a, b = results[off][r][w], results[on][r][w]
            rate = "-" if b["acceptance_rate"] is None else f"{100 * b['acceptance_rate']:.0f}%"
            length = "-" if b["mean_accepted_length"] is None else \
                f"{b['mean_accepted_length']:.2f}"
            print(f"| {w} | {r + 1} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
                  f"{b['tok_s'] / a['tok_s']:.2f}x | {rate} ({b['accepted']} of "
                  f"{b['proposed']}) | {length} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--save", default=None, metavar="FILE")
    p.add_argument("--draft", action="store_true",
                   help="also the float model without and with its 4-bit self-draft")
    p.add_argument("--draft-k", type=int, default=4,
                   help="num_speculative_tokens of the self-draft")
    p.add_argument("--llama-cpp", action="store_true",
                   help="only: Folio and llama-server beside each other, each with and "
                        "without a draft model")
    p.add_argument("--only-standard", action="store_true",
                   help="only the two 32-request workloads, each configuration in turn")
    p.add_argument("--sweep", default=None, metavar="N,N,..",
                   help="only: the first N standard requests at once, for each N")
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
    if args.llama_cpp:
        results = {"llama_cpp": beside_llama_cpp(args.rounds, args.draft_k)}
        if args.save:
            with open(args.save, "w") as f:
                json.dump(results, f, indent=1)
        return
    ngram = f"ngram k={args.k}"
    configs = {"off": ({}, None),
               ngram: ({}, {"method": "ngram", "num_speculative_tokens": args.k,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})}
    pairs = [("off", ngram)]
    if args.draft:
        from folio.model.loader import resolve_model_path
        gguf, _ = resolve_model_path(None)
        as_float = {"quantization": "none", "dtype": "bfloat16"}
        configs["float"] = (as_float, None)
        configs[f"float, 4-bit self-draft k={args.draft_k}"] = (as_float, {
            "method": "draft_model", "model": gguf, "num_speculative_tokens": args.draft_k})
        pairs.append(("float", f"float, 4-bit self-draft k={args.draft_k}"))
    if args.sweep:
        sizes = [int(n) for n in args.sweep.split(",")]
        results = {"sweep": batch_sweep(configs, pairs, standard, sizes, args.rounds)}
        if args.save:
            with open(args.save, "w") as f:
                json.dump(results, f, indent=1)
        return
    results: dict = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (engine, spec) in configs.items():
            res = run_config(spec, standard, random_ids, args.only_standard, **engine)
            results[name].append(res)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{w} {v['tok_s']:.1f} tok/s" for w, v in res.items()), flush=True)
    for off, on in pairs:
        _table(results, off, on, args.rounds, list(results[off][0]))
    on = ngram
    if args.served:
        serve_runs = {name: served(configs[name][1], args.rounds) for name in ("off", ngram)}
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
