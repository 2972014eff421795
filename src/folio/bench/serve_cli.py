"""The `folio bench serve` command: workload, one run or a sweep, report, plot."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Optional

from folio.bench.datasets import jsonl_requests, parse_range, random_requests
from folio.bench.serve import _drive, parse_slo, summarize


def _served_model(args) -> str:
    if args.model:
        return args.model
    req = urllib.request.Request(args.base_url + "/v1/models", headers=(
        {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}))
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _workload(args, model: str, seed: int):
    from folio.model.loader import load_model_config
    from folio.tokenizer import get_tokenizer
    source: Optional[str] = args.tokenizer or args.model
    try:
        tokenizer = get_tokenizer(load_model_config(source))
    except ValueError:
        tokenizer = get_tokenizer(load_model_config(None))
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, parse_range(args.input_len),
                                   parse_range(args.output_len), tokenizer.vocab_size,
                                   tokenizer.all_special_ids, seed)
    else:
        requests = jsonl_requests(args.dataset, tokenizer)[:args.num_prompts]
    chat = args.endpoint == "/v1/chat/completions"
    texts = [r.prompt if r.prompt is not None else
             (tokenizer.decode(r.prompt_token_ids) if chat else None) for r in requests]
    return requests, texts


def _line(s: dict) -> str:
    return (f"rate {s['request_rate']}: {s['completed']} ok, {s['failed']} failed in "
            f"{s['seconds']:.1f} s | {s['request_throughput']:.2f} req/s, "
            f"{s['output_throughput']:.1f} out tok/s | TTFT median {s['ttft_ms']['median']:.0f} "
            f"p99 {s['ttft_ms']['p99']:.0f} ms | TPOT median {_ms(s['tpot_ms']['median'])} "
            f"p99 {_ms(s['tpot_ms']['p99'])} ms | ITL p99 {_ms(s['itl_ms']['p99'])} ms"
            + (f" | goodput {s['goodput']:.2f} req/s" if "goodput" in s else ""))


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def plot_sweep(summaries: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--sweep-rates plots with matplotlib: pip install folio-llm[bench]") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = [s["request_rate"] for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, ax in (("ttft_ms", axes[0]), ("tpot_ms", axes[1])):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(rates, [s[key][stat] for s in summaries], style, label=stat)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(key.replace("_ms", " (ms)").upper())
        ax.legend()
        ax.grid(alpha=0.3)
    axes[2].plot(rates, [s["output_throughput"] for s in summaries], "o-")
    axes[2].set_xlabel("request rate (req/s)")
    axes[2].set_ylabel("output tokens/s")
    axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cmd_bench_serve(args) -> int:
    model = _served_model(args)
    slo = parse_slo(args.slo)
    rates = ([float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates
             else [args.request_rate])
    summaries = []
    for i, rate in enumerate(rates):
        # Each rate of a sweep draws its own random prompts: with the same ones
        # every later rate would find them in the server's prefix cache.
        requests, texts = _workload(args, model, args.seed + i)
        results, seconds = asyncio.run(_drive(args, model, requests, texts, rate))
        summary = summarize(results, seconds, slo, rate)
        summaries.append(summary)
        if not args.json:
            print(_line(summary), flush=True)
    result = {"model": model, "endpoint": args.endpoint, "num_prompts": len(requests),
              "max_concurrency": args.max_concurrency, "runs": summaries}
    if args.sweep_rates:
        plot_sweep(summaries, args.plot, f"folio bench serve: {model}, {len(requests)} "
                                         f"requests, {args.input_len} in / {args.output_len} out")
        result["plot"] = args.plot
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
