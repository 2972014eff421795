"""The `folio bench serve` command: workload, one run or a sweep, report, plot."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Optional

from folio.bench.args import format_range, write_result
from folio.bench.datasets import jsonl_requests, random_requests
from folio.bench.serve import _drive, spec_decode_run, summarize


def _get_json(args, path: str):
    """GET a JSON document from the server; a server that is down, refuses the
    key or answers something else is one clear error, not a traceback."""
    url = args.base_url + path
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        hint = " (check --api-key)" if e.code in (401, 403) else ""
        raise ValueError(f"{url} answered HTTP {e.code} {e.reason}{hint}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach {args.base_url}: {_reason(e.reason)}") from None
    except OSError as e:             # a timeout or reset while the answer was read
        raise ValueError(f"cannot reach {args.base_url}: {_reason(e)}") from None
    except json.JSONDecodeError:
        raise ValueError(f"{url} did not answer JSON: is {args.base_url} a Folio "
                         f"(OpenAI-compatible) server?") from None


def _reason(reason) -> str:
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[0].lower() + reason.strerror[1:]
    return str(reason)


def _served_model(args) -> str:
    """--model, else the server's first model; asked of the server either way,
    so that a server that is down, or does not serve --model, fails here,
    before any work."""
    models = _get_json(args, "/v1/models").get("data") or []
    served = [m["id"] for m in models if isinstance(m, dict) and "id" in m]
    if args.model:
        if served and args.model not in served:
            _check_unlisted_model(args, served)
        return args.model
    if not served:
        raise ValueError(f"{args.base_url}/v1/models lists no model: pass --model")
    return served[0]


def _check_unlisted_model(args, served: list[str]) -> None:
    """A --model that /v1/models does not list: one request of one token says
    whether the server takes it anyway (llama-server answers any name) or
    refuses it with a 404, which is then the error, naming what it serves."""
    body = {"model": args.model, "max_tokens": 1, "temperature": 0}
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request = urllib.request.Request(args.base_url + args.endpoint,
                                     data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60):
            return
    except urllib.error.HTTPError as e:
        if e.code != 404:
            return          # another refusal: the run reports it per request
        message = _error_message(e)
    except (urllib.error.URLError, OSError):
        return              # the run reports it per request
    raise ValueError(f"{args.base_url} does not serve --model {args.model!r} (HTTP 404: "
                     f"{message}); it serves: {', '.join(served)}")


def _error_message(e: "urllib.error.HTTPError") -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    text = e.read().decode(errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200] or e.reason


def _workload(args, model: str, seed: int):
    from folio.model.loader import load_model_config
    from folio.tokenizer import get_tokenizer
    source: Optional[str] = args.tokenizer or args.model
    try:
        tokenizer = get_tokenizer(load_model_config(source))
    except ValueError:
        tokenizer = get_tokenizer(load_model_config(None))
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                                   tokenizer.vocab_size, tokenizer.all_special_ids, seed)
    else:
        requests = jsonl_requests(args.dataset, tokenizer)[:args.num_prompts]
    chat = args.endpoint == "/v1/chat/completions"
    texts = [r.prompt if r.prompt is not None else
             (tokenizer.decode(r.prompt_token_ids) if chat else None) for r in requests]
    return requests, texts


def _costs(args, summary: dict) -> dict:
    """The run's $/1K tokens, from its throughput and as the server reports it."""
    from folio.bench.serve import cost_from_throughput, server_cost
    url = args.base_url + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            served = server_cost(r.read().decode())
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot read {url}: {_reason(getattr(e, 'reason', e))}") from None
    if not served:
        raise ValueError(f"{url} has no folio:cost_per_1k_tokens: start the server with "
                         f"--cost-per-hour")
    return {"from_throughput": cost_from_throughput(summary, args.cost_per_hour,
                                                    args.prompt_token_weight),
            "server": served}


def _spec_totals(args):
    """The server's speculative decoding counters now (None: none, or no /metrics)."""
    from folio.bench.serve import spec_decode_totals
    try:
        with urllib.request.urlopen(args.base_url + "/metrics", timeout=30) as r:
            return spec_decode_totals(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _line(s: dict) -> str:
    """One run's summary; a figure no request completed to give is '-'."""
    return (f"rate {s['request_rate']}: {s['completed']} ok, {s['failed']} failed in "
            f"{s['seconds']:.1f} s | {s['request_throughput']:.2f} req/s, "
            f"{s['output_throughput']:.1f} out tok/s | TTFT median "
            f"{_ms(s['ttft_ms']['median'], '.0f')} p99 {_ms(s['ttft_ms']['p99'], '.0f')} ms | "
            f"TPOT median {_ms(s['tpot_ms']['median'])} "
            f"p99 {_ms(s['tpot_ms']['p99'])} ms | ITL p99 {_ms(s['itl_ms']['p99'])} ms"
            + (f" | goodput {s['goodput']:.2f} req/s" if "goodput" in s else "")
            + (f" | $/1K output tokens: "
               f"{_ms(s['cost_per_1k']['from_throughput']['output'], '.5f')} from throughput, "
               f"{_ms(s['cost_per_1k']['server'].get('output'), '.5f')} the server's"
               if "cost_per_1k" in s else "")
            + (f" | speculative: {s['spec_decode']['num_accepted_tokens']} of "
               f"{s['spec_decode']['num_draft_tokens']} proposed accepted "
               f"({100 * s['spec_decode']['acceptance_rate']:.0f}%)"
               if s.get("spec_decode") else "")
            + (f" | first error: {s['errors'][0]}" if s["failed"] and s["errors"] else ""))


def _ms(v, spec: str = ".1f") -> str:
    return "-" if v is None or v != v else format(v, spec)


def _need_matplotlib() -> None:
    # Checked before a sweep starts: it must not fail after minutes of runs.
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the sweep plot needs matplotlib: pip install matplotlib (in the "
                         "checkout: pip install -e '.[bench]')") from None


def _title(result: dict) -> str:
    """What was run, from the saved result (older results lack the lengths)."""
    if result.get("dataset", "random") != "random":
        work = result["dataset"]
    elif "input_len" in result:
        work = f"prompt {result['input_len']} / output {result['output_len']} tokens"
    else:
        work = "random prompts"
    return (f"folio bench serve {result.get('endpoint', '')}: {result.get('model', '?')}, "
            f"{result.get('num_prompts', '?')} requests per rate, {work}")


def _replot(args) -> int:
    from folio.bench.sweep_plot import check_plottable, plot_sweep
    try:
        with open(args.from_result) as f:
            result = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{args.from_result} is not JSON: {e}") from None
    runs = check_plottable(result)
    _need_matplotlib()
    plot_sweep(runs, args.plot, _title(result))
    print(f"wrote {args.plot} from {len(runs)} runs of {args.from_result}")
    return 0


def cmd_bench_serve(args) -> int:
    if args.from_result:
        return _replot(args)
    if args.sweep_rates:
        _need_matplotlib()
    model = _served_model(args)
    slo = args.slo or {}
    summaries = []
    for i, rate in enumerate(args.sweep_rates or [args.request_rate]):
        # Each rate of a sweep draws its own random prompts: with the same ones
        # every later rate would find them in the server's prefix cache.
        requests, texts = _workload(args, model, args.seed + i)
        spec_before = _spec_totals(args)
        results, seconds = asyncio.run(_drive(args, model, requests, texts, rate))
        summaries.append(summarize(results, seconds, slo, rate))
        spec = spec_decode_run(spec_before, _spec_totals(args))
        if spec is not None:
            summaries[-1]["spec_decode"] = spec
        if args.cost_per_hour:
            summaries[-1]["cost_per_1k"] = _costs(args, summaries[-1])
        if not args.json:
            print(_line(summaries[-1]), flush=True)
    result = {"model": model, "endpoint": args.endpoint, "num_prompts": len(requests),
              "max_concurrency": args.max_concurrency, "dataset": args.dataset,
              "input_len": format_range(args.input_len),
              "output_len": format_range(args.output_len), "seed": args.seed,
              "runs": summaries}
    if all(s["completed"] == 0 for s in summaries):  # nothing measured: no plot or result
        s = summaries[0]
        raise ValueError(f"every request at rate {s['request_rate']} failed: "
                         f"{s['errors'][0] if s['errors'] else 'no answer'}")
    # a sweep whose top rates failed whole keeps the rates below (the saturation point it
    # looked for), and exits 1 as any failure does
    if args.sweep_rates:
        from folio.bench.sweep_plot import plot_sweep
        plot_sweep([s for s in summaries if s["completed"]], args.plot, _title(result))
        result["plot"] = args.plot
    write_result(args, result)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
