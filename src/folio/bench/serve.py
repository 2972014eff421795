"""`folio bench serve`: drive a running server with streaming requests.

Arrivals are Poisson at --request-rate (default: all at once), capped by
--max-concurrency. Every request streams; the client times the first token
(TTFT), each later chunk (inter-token latency), the time per output token after
the first (TPOT) and the whole request (E2E).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

from folio.bench.args import (checked, dataset, existing_file, http_url, output_path,
                              request_rate, request_rates)
from folio.bench.datasets import BenchRequest
from folio.cli_types import length_range, non_negative_float, positive_float, positive_int
from folio.core.spec_decode import SpecDecodeCounts


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", type=http_url, metavar="URL", default="http://127.0.0.1:8000",
                   help="the server to drive; checked to answer before the run starts")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"],
                   help="the API every request goes to (chat sends the prompt as one user message)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="served model name to request; without it, the server's first model")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="model whose tokenizer builds the workload; without it, --model's, "
                        "else the default model's")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--request-rate", type=request_rate, metavar="RATE", default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends them all at once")
    p.add_argument("--max-concurrency", type=positive_int, metavar="N", default=None,
                   help="most requests in flight at once; unset, no cap")
    p.add_argument("--dataset", type=dataset, metavar="random|FILE", default="random",
                   help="'random' (uniform lengths, random token ids) or a JSONL file of requests")
    p.add_argument("--num-prompts", type=positive_int, metavar="N", default=32,
                   help="requests per run (per rate of a sweep)")
    p.add_argument("--input-len", type=length_range, metavar="A:B", default="32:384",
                   help="prompt tokens of the random dataset: A:B drawn uniformly, or N")
    p.add_argument("--output-len", type=length_range, metavar="A:B", default="32:192",
                   help="output tokens (max_tokens) of the random dataset: A:B drawn uniformly, "
                        "or N")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the arrival times and the random prompts (rate i of a sweep "
                        "draws its prompts with seed + i)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate each request's full max_tokens")
    p.add_argument("--slo", type=slo_targets, metavar="NAME=MS,...", default=None,
                   help="goodput targets in ms, e.g. ttft_ms=500,tpot_ms=50 (also e2e_ms)")
    p.add_argument("--cost-per-hour", type=positive_float, metavar="DOLLARS", default=None,
                   help="what the server's machine costs an hour: each run reports the $/1K "
                        "tokens its own throughput gives beside the server's "
                        "folio:cost_per_1k_tokens (serve with the same --cost-per-hour)")
    p.add_argument("--prompt-token-weight", type=non_negative_float, metavar="W", default=0.25,
                   help="a prompt token's cost as a share of an output token's (as the server's)")
    p.add_argument("--save-result", type=output_path, metavar="FILE", default=None,
                   help="write the result JSON (every run's summary) to this file")
    p.add_argument("--sweep-rates", type=request_rates, metavar="RATES", default=None,
                   help="comma-separated rates, e.g. 1,2,4,inf: run each and plot to --plot")
    p.add_argument("--plot", type=output_path, metavar="FILE", default="bench-serve-sweep.png",
                   help="PNG of the sweep: throughput, TTFT, TPOT/ITL and E2E against the rate")
    p.add_argument("--from-result", type=existing_file, metavar="FILE", default=None,
                   help="re-plot a sweep saved with --save-result to --plot, sending no request")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def cost_from_throughput(summary: dict, cost_per_hour: float, weight: float) -> dict:
    """$/1K tokens from a run's own throughput, weighted as the server weighs them:
    the machine's cost per second over (weight x prompt + output) tokens per second."""
    from folio.server.cost import per_1k_tokens
    out = summary["output_throughput"]
    prompt, output = per_1k_tokens(cost_per_hour, 1.0, summary["total_token_throughput"] - out,
                                   out, weight)
    return {"prompt": None if math.isnan(prompt) else prompt,
            "output": None if math.isnan(output) else output}


def server_cost(metrics_text: str) -> dict:
    """The server's folio:cost_per_1k_tokens gauges, by kind (absent: not served)."""
    from prometheus_client.parser import text_string_to_metric_families
    return {sample.labels["kind"]: sample.value
            for family in text_string_to_metric_families(metrics_text)
            if family.name == "folio:cost_per_1k_tokens" for sample in family.samples}


_SPEC = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_totals(metrics_text: str) -> Optional[SpecDecodeCounts]:
    """The server's speculative decoding counters (drafts, proposed tokens,
    accepted tokens), Folio's `folio:` or vLLM's `vllm:` names; None where the
    server has none."""
    from prometheus_client.parser import text_string_to_metric_families
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        prefix, _, name = family.name.partition(":spec_decode_")
        name = name.removesuffix("_total")
        if prefix in ("folio", "vllm") and name in _SPEC:
            found[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return SpecDecodeCounts(*(found[n] for n in _SPEC)) if len(found) == len(_SPEC) else None


def spec_decode_run(before, after) -> Optional[dict]:
    """A run's share of the counters: proposed, accepted, their rate and the
    tokens a step with proposals yielded; None without counters or proposals."""
    if before is None or after is None:
        return None
    run = after.since(before)
    if run.draft_tokens <= 0:
        return None
    return {"num_draft_tokens": int(run.draft_tokens),
            "num_accepted_tokens": int(run.accepted_tokens),
            "acceptance_rate": run.acceptance_rate,
            "mean_accepted_length": run.mean_accepted_length}


def parse_slo(text: Optional[str]) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("ttft_ms", "tpot_ms", "e2e_ms"):
            raise ValueError(f"unknown SLO {key!r}: use ttft_ms, tpot_ms, e2e_ms")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"an SLO is NAME=MILLISECONDS, got {part!r}") from None
        if not out[key.strip()] > 0:
            raise ValueError(f"an SLO target must be > 0 ms, got {part!r}")
    return out


slo_targets = checked(parse_slo, "SLO")


def _payload(args, model: str, req: BenchRequest, text: Optional[str]) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt_token_ids if text is None else text
    return body


async def _one(session, args, model: str, req: BenchRequest, text: Optional[str]) -> Result:
    result = Result(ok=False, prompt_tokens=len(req.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with session.post(args.base_url + args.endpoint,
                                json=_payload(args, model, req, text)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as e:          # noqa: BLE001 - counted as a failed request
        result.error = repr(e)
    return result


async def _drive(args, model: str, requests: list[BenchRequest], texts, rate: float):
    import aiohttp
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    # A connection per request: a server that closes a connection after its
    # stream ends (llama-server does) would otherwise fail the next request
    # sent on the pooled one with "Server disconnected".

    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        async def gated(req, text):
            async with limit:
                return await _one(session, args, model, req, text)

        tasks, t0 = [], time.perf_counter()
        for req, text in zip(requests, texts):
            tasks.append(asyncio.ensure_future(gated(req, text)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values) * 1000, "median": statistics.median(values) * 1000,
            "p99": p99 * 1000}


def summarize(results: list[Result], seconds: float, slo: dict[str, float], rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def good(r: Result) -> bool:
        checks = {"ttft_ms": r.ttft, "tpot_ms": r.tpot or 0.0, "e2e_ms": r.e2e}
        return all(checks[k] * 1000 <= v for k, v in slo.items())

    summary = {
        "request_rate": rate if rate != float("inf") else "inf",
        "completed": len(ok), "failed": len(results) - len(ok), "seconds": seconds,
        "request_throughput": len(ok) / seconds, "output_throughput": out_tokens / seconds,
        "total_token_throughput": (in_tokens + out_tokens) / seconds,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    if slo:
        summary["slo"] = slo
        summary["goodput"] = sum(good(r) for r in ok) / seconds
    return summary
