"""`folio bench throughput`: the engine in-process on a workload, against the
transformers baselines and the machine's matmul ceiling, in one run."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from folio.bench.args import dataset
from folio.bench.datasets import BenchRequest, jsonl_requests, random_requests
from folio.cli_types import length_range, positive_int

# torch is imported inside the functions that run the benchmark: building the
# parser (and rejecting a bad flag) must not wait seconds for it.


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", type=dataset, metavar="random|FILE", default="random",
                   help="'random' (uniform lengths, random token ids) or a JSONL file of "
                        "requests, one {\"prompt\" or \"prompt_token_ids\", \"max_tokens\"} a line")
    p.add_argument("--num-prompts", type=positive_int, metavar="N", default=32,
                   help="number of requests (a JSONL dataset is cut to its first N)")
    p.add_argument("--input-len", type=length_range, metavar="A:B", default="32:384",
                   help="prompt tokens of the random dataset: A:B drawn uniformly, or N")
    p.add_argument("--output-len", type=length_range, metavar="A:B", default="32:192",
                   help="output tokens of the random dataset: A:B drawn uniformly, or N")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate each request's full output length even past an EOS token")
    p.add_argument("--batching", choices=["continuous", "static", "both"], default="continuous",
                   help="static: fixed batches, the next admitted when the whole previous one "
                        "finished; both: continuous, then static on the same engine")
    p.add_argument("--batch-size", type=positive_int, metavar="N", default=8,
                   help="requests per batch of --batching static|both")
    p.add_argument("--baseline", action="append", choices=["hf-seq", "hf-static", "llama-cpp"],
                   default=[], help="baseline(s) in the same run (repeatable): transformers "
                                    "one at a time or in static batches, or llama.cpp's "
                                    "llama-server on the same GGUF file")
    p.add_argument("--baseline-batch", type=positive_int, metavar="N", default=8,
                   help="batch size of the hf-static baseline; slots of the llama-cpp one")
    p.add_argument("--llama-server", metavar="PATH", default=None,
                   help="the llama-server binary of the llama-cpp baseline; without it, one on "
                        "PATH, else the checkout's scripts/install_llama_cpp.sh build")
    p.add_argument("--baseline-limit", type=positive_int, metavar="K", default=None,
                   help="run the baselines on the first K requests only (rates are compared)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_requests(args, engine) -> list[BenchRequest]:
    if args.dataset == "random":
        tok = engine.tokenizer
        return random_requests(args.num_prompts, args.input_len, args.output_len,
                               engine.config.model.vocab_size, tok.all_special_ids, args.seed)
    return jsonl_requests(args.dataset, engine.tokenizer)[:args.num_prompts]


def run_engine(engine, requests: list[BenchRequest], ignore_eos: bool, batching: str,
               batch_size: int, progress=None) -> tuple[list[int], float]:
    """(output tokens per request, seconds); static batching admits the next
    batch only when the whole previous one finished."""
    from folio import SamplingParams
    groups = [requests] if batching == "continuous" else [
        requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    produced: dict[str, int] = {}
    t0 = time.perf_counter()
    for g, group in enumerate(groups):
        for i, r in enumerate(group):
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=ignore_eos)
            engine.add_tokenized_request(f"bench-{g}-{i}", r.prompt, r.prompt_token_ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    produced[out.request_id] = len(out.outputs[0].token_ids)
                    if progress:
                        progress(1)
    seconds = time.perf_counter() - t0
    order = [f"bench-{g}-{i}" for g, group in enumerate(groups) for i in range(len(group))]
    return [produced[k] for k in order], seconds


def _warm_up(engine) -> None:
    from folio import SamplingParams
    engine.add_tokenized_request("warmup", None, [1] * 16,
                                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None, None
    from tqdm.auto import tqdm
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)
    return bar, bar.update


def check_baselines(args, engine) -> str | None:
    """The llama-server binary when the llama-cpp baseline is asked for; a bad
    baseline is refused before anything is timed."""
    if "llama-cpp" not in args.baseline:
        return None
    from folio.bench.llama_cpp import check_gguf, find_llama_server
    check_gguf(engine.config.model.format, engine.config.model.path)
    return find_llama_server(args.llama_server)


def run_baselines(args, engine, requests, llama_server: str | None = None) -> list[dict]:
    import torch

    from folio.bench.baselines import load_hf_model, run_hf_seq, run_hf_static
    from folio.bench.llama_cpp import run_llama_cpp
    model = None
    if any(name.startswith("hf-") for name in args.baseline):
        model = load_hf_model(engine.config.model, getattr(torch, engine.config.dtype))
    subset = requests[:args.baseline_limit] if args.baseline_limit else requests
    results = []
    for name in args.baseline:
        bar, tick = _bar(len(subset), name, not args.json)
        if name == "hf-seq":
            tokens, seconds = run_hf_seq(model, subset, tick)
        elif name == "hf-static":
            tokens, seconds = run_hf_static(model, subset, args.baseline_batch, tick)
        else:
            tokens, seconds = run_llama_cpp(llama_server, engine.config.model.path, subset,
                                            args.baseline_batch, torch.get_num_threads(), tick)
        if bar:
            bar.close()
        results.append({"name": name, "requests": len(subset), "output_tokens": tokens,
                        "seconds": seconds, "output_tokens_per_s": tokens / seconds})
    return results


def _timed_run(args, engine, requests, mode: str):
    # Every timed run starts cold: a second run of the same prompts would
    # otherwise find them all in the prefix cache and skip their prefill.
    if not engine.reset_prefix_cache():
        raise RuntimeError("the engine still holds requests before a timed run")
    bar, tick = _bar(len(requests), f"folio ({mode})", not args.json)
    produced, seconds = run_engine(engine, requests, args.ignore_eos, mode, args.batch_size, tick)
    if bar:
        bar.close()
    return produced, seconds


def bench_throughput(args, engine) -> dict:
    import torch

    from folio.bench.flops import measure_ceiling, workload_flops
    llama_server = check_baselines(args, engine)
    requests = build_requests(args, engine)
    m, dtype = engine.config.model, getattr(torch, engine.config.dtype)
    ceiling = measure_ceiling(m, dtype, engine.config.device)
    _warm_up(engine)
    mode = "continuous" if args.batching == "both" else args.batching
    spec_before = engine.scheduler.spec_counts
    produced, seconds = _timed_run(args, engine, requests, mode)
    spec = engine.scheduler.spec_counts.since(spec_before)
    done = [replace(r, max_tokens=n) for r, n in zip(requests, produced)]
    prompt_tokens, output_tokens = sum(len(r.prompt_token_ids) for r in done), sum(produced)
    result = {
        "model": m.model, "dtype": engine.config.dtype,
        "kv_cache_dtype": engine.config.kv_dtype, "batching": args.batching,
        "requests": len(done), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "seconds": seconds, "requests_per_s": len(done) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
        "ceiling_gflops": ceiling,
        "ceiling_fraction": workload_flops(m, done) / seconds / (ceiling * 1e9),
        "threads": torch.get_num_threads(), "batch_size": args.batch_size,
    }
    if engine.config.scheduler.speculative is not None:
        result["spec_decode"] = spec.summary()
    if args.batching == "both":
        static_produced, static_seconds = _timed_run(args, engine, requests, "static")
        result["static_output_tokens_per_s"] = sum(static_produced) / static_seconds
        result["continuous_over_static"] = (result["output_tokens_per_s"]
                                            / result["static_output_tokens_per_s"])
    baselines = run_baselines(args, engine, requests, llama_server)
    for b in baselines:
        b["speedup"] = result["output_tokens_per_s"] / b["output_tokens_per_s"]
    if baselines:
        result.update(baseline=baselines[0]["name"],
                      baseline_output_tokens_per_s=baselines[0]["output_tokens_per_s"],
                      speedup=baselines[0]["speedup"], baselines=baselines)
    return result


def print_report(result: dict) -> None:
    print(f"model {result['model']} ({result['dtype']}, {result['batching']} batching, "
          f"{result['threads']} threads)")
    print(f"requests {result['requests']}  prompt tokens {result['prompt_tokens']}  "
          f"output tokens {result['output_tokens']}  in {result['seconds']:.2f} s")
    print(f"throughput {result['requests_per_s']:.2f} req/s  "
          f"{result['output_tokens_per_s']:.1f} output tok/s  "
          f"{result['total_tokens_per_s']:.1f} total tok/s")
    print(f"ceiling {result['ceiling_gflops']:.1f} GFLOP/s  "
          f"fraction {100 * result['ceiling_fraction']:.1f}%")
    spec = result.get("spec_decode")
    if spec:
        rate = "-" if spec["acceptance_rate"] is None else \
            f"{100 * spec['acceptance_rate']:.1f}%"
        length = "-" if spec["mean_accepted_length"] is None else \
            f"{spec['mean_accepted_length']:.2f}"
        print(f"speculative decoding: {spec['num_accepted_tokens']} of "
              f"{spec['num_draft_tokens']} proposed tokens accepted ({rate}), "
              f"{length} tokens a step with proposals")
    if "continuous_over_static" in result:
        print(f"static batching (batch {result.get('batch_size', '')}) "
              f"{result['static_output_tokens_per_s']:.1f} output tok/s  ->  continuous is "
              f"{result['continuous_over_static']:.2f}x")
    for b in result.get("baselines", []):
        print(f"baseline {b['name']}: {b['output_tokens_per_s']:.1f} output tok/s on "
              f"{b['requests']} requests  ->  speedup {b['speedup']:.2f}x")
