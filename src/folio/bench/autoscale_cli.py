"""The `folio bench autoscale` command: the trace, the policies side by side, the
table, the saved result and the plot. The simulation itself is
folio.bench.autoscale."""

from __future__ import annotations

import argparse
import json
import math
import random

from folio.bench.args import checked, existing_file, output_path, write_result
from folio.cli_types import length_range, positive_float, probability
from folio.bench.autoscale import ROUTINGS, Behaviour, Policy, ServiceCurve, simulate, summarize


def _counts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError(f"expected replica counts >= 1 such as 2,6, got {text!r}")
        out.append(int(part))
    return out


def shares(text: str) -> list[float]:
    """Utilization targets: shares in (0, 1], comma-separated."""
    return [probability(p) for p in text.split(",")]


counts = checked(_counts, "replica counts")


def add_autoscale_args(p: argparse.ArgumentParser) -> None:
    from folio.bench.serve import slo_targets
    p.add_argument("--service-curve", type=existing_file, metavar="FILE", required=True,
                   help="a `folio bench serve --sweep-rates ... --save-result` JSON: one "
                        "replica's TTFT and TPOT against its load")
    p.add_argument("--values", type=existing_file, metavar="FILE", default=None,
                   help="a Helm values file of deploy/helm/folio: its autoscaling bounds, "
                        "target and behaviour, and maxNumSeqs (default: the chart's defaults)")
    p.add_argument("--trace-file", type=existing_file, metavar="FILE", default=None,
                   help="JSONL of arrivals, {\"time\": seconds, \"output_len\": tokens} a line, "
                        "instead of the Poisson trace with bursts")
    p.add_argument("--shape", choices=["wave", "bursts"], default="wave",
                   help="the generated trace's rate: wave (from --base-rate up to --peak-rate "
                        "and back, once every --period-s) or bursts (--peak-rate for "
                        "--burst-len-s once every --period-s, a third of the way in)")
    p.add_argument("--duration-s", type=positive_float, default=7200.0, metavar="S",
                   help="length of the generated trace")
    p.add_argument("--base-rate", type=positive_float, default=0.5, metavar="RATE",
                   help="requests per second at the trough (Poisson arrivals)")
    p.add_argument("--peak-rate", type=positive_float, default=12.0, metavar="RATE",
                   help="requests per second at the peak")
    p.add_argument("--period-s", type=positive_float, default=1800.0, metavar="S",
                   help="one wave, or one burst, in every period of this length")
    p.add_argument("--burst-len-s", type=positive_float, default=300.0, metavar="S",
                   help="how long a burst lasts (--shape bursts)")
    p.add_argument("--output-len", type=length_range, default="32:128", metavar="A:B",
                   help="output tokens of a generated request, uniform in A:B (match the sweep)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="the trace's seed")
    p.add_argument("--startup-s", type=positive_float, default=120.0, metavar="S",
                   help="from a replica's request to its readiness (schedule, pull, load)")
    p.add_argument("--sync-s", type=positive_float, default=15.0, metavar="S",
                   help="the autoscaler's period (the HPA's sync period, KEDA's polling)")
    p.add_argument("--tick-s", type=positive_float, default=0.1, metavar="S",
                   help="the simulation's time step")
    p.add_argument("--routing", choices=ROUTINGS,
                   default="round-robin",
                   help="how requests reach replicas: round-robin (a Kubernetes Service) or "
                        "least-outstanding (a least-request load balancer in front)")
    p.add_argument("--fixed-replicas", type=counts, default=[3, 6], metavar="N,...",
                   help="fixed pools to compare against")
    p.add_argument("--utilization-targets", type=shares, default=[0.6, 0.95], metavar="U,...",
                   help="busy-share targets of the utilization-keyed HPA")
    p.add_argument("--slo", type=slo_targets, default="ttft_ms=2000,tpot_ms=100",
                   metavar="NAME=MS,...", help="the latency objective: ttft_ms and tpot_ms")
    p.add_argument("--plot", type=output_path, default=None, metavar="FILE",
                   help="PNG of offered load, replicas, waiting requests and TTFT over time")
    p.add_argument("--save-result", type=output_path, default=None, metavar="FILE",
                   help="write the result JSON to this file")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


CHART_DEFAULTS = {"maxNumSeqs": 16, "autoscaling": {
    "minReplicas": 1, "maxReplicas": 8, "targetWaitingPerReplica": 2,
    "scaleUp": {"stabilizationWindowSeconds": 0, "pods": 2, "periodSeconds": 60},
    "scaleDown": {"stabilizationWindowSeconds": 300, "pods": 1, "periodSeconds": 120}}}


def chart_settings(path) -> tuple[Behaviour, float, int]:
    """(behaviour, waiting target, max_num_seqs) from a values file, or the chart's defaults."""
    values = CHART_DEFAULTS
    if path:
        import yaml
        with open(path) as f:
            given = yaml.safe_load(f) or {}
        values = _merged(CHART_DEFAULTS, given) if isinstance(given, dict) else given
    try:
        a = values["autoscaling"]
        up, down = a["scaleUp"], a["scaleDown"]
        bounds = dict(
            min_replicas=int(a["minReplicas"]), max_replicas=int(a["maxReplicas"]),
            up_window_s=float(up["stabilizationWindowSeconds"]), up_pods=int(up["pods"]),
            up_period_s=float(up["periodSeconds"]),
            down_window_s=float(down["stabilizationWindowSeconds"]),
            down_pods=int(down["pods"]), down_period_s=float(down["periodSeconds"]))
        target, seqs = float(a["targetWaitingPerReplica"]), int(values["maxNumSeqs"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a values file of deploy/helm/folio: {e!r} "
                         f"missing or wrong") from None
    return Behaviour(**bounds), target, seqs      # impossible bounds: refused as the chart does


def _merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`, as Helm merges a values file over the chart's."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) \
            else v
    return out


def generated_trace(args) -> list[tuple[float, int]]:
    """Poisson arrivals at the rate `rate_at` gives (drawn by thinning), each with
    an output length drawn from --output-len."""
    rng = random.Random(args.seed)
    lo, hi = args.output_len
    peak = max(args.base_rate, args.peak_rate)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= args.duration_s:
            return out
        if rng.random() * peak < rate_at(args, t):
            out.append((t, rng.randint(lo, hi)))


def rate_at(args, t: float) -> float:
    base, peak, period = args.base_rate, args.peak_rate, args.period_s
    if args.shape == "wave":
        return base + (peak - base) * (1 - math.cos(2 * math.pi * t / period)) / 2
    phase = t % period - period / 3
    return peak if 0 <= phase < args.burst_len_s else base


def read_trace(path) -> list[tuple[float, int]]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append((float(row["time"]), int(row["output_len"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{i}: expected {{\"time\": seconds, \"output_len\": "
                                 f"tokens}}, got {line.strip()[:80]!r}") from None
    if not out:
        raise ValueError(f"{path} holds no arrival")
    return sorted(out)


def policies(args, target: float) -> list[Policy]:
    out = [Policy(f"fixed {n}", "fixed", replicas=n) for n in args.fixed_replicas]
    out.append(Policy(f"HPA on queue (target {target:g} waiting)", "queue", target=target))
    out += [Policy(f"HPA on utilization (target {u:.0%})", "utilization", target=u)
            for u in args.utilization_targets]
    return out


def cmd_bench_autoscale(args) -> int:
    with open(args.service_curve) as f:
        curve = ServiceCurve.from_sweep(json.load(f))
    behaviour, target, max_num_seqs = chart_settings(args.values)
    arrivals = read_trace(args.trace_file) if args.trace_file else generated_trace(args)
    slo = {"ttft_ms": 2000.0, "tpot_ms": 100.0, **(args.slo or {})}
    runs, series = [], []
    for policy in policies(args, target):
        requests, pool, trace = simulate(curve, arrivals, policy, behaviour, max_num_seqs,
                                         args.startup_s, args.sync_s, args.tick_s,
                                         args.routing)
        runs.append({"policy": policy.name, **summarize(requests, pool, trace,
                                                         slo["ttft_ms"] / 1000,
                                                         slo["tpot_ms"] / 1000)})
        series.append((policy.name, requests, trace))
    result = {"service_curve": {"file": args.service_curve,
                                "concurrency": curve.concurrency, "ttft_s": curve.ttft_s,
                                "tpot_s": curve.tpot_s},
              "arrivals": len(arrivals),
              "trace": args.trace_file or {k: getattr(args, k) for k in (
                  "shape", "duration_s", "base_rate", "peak_rate", "period_s", "burst_len_s",
                  "output_len", "seed")},
              "routing": args.routing,
              "max_num_seqs": max_num_seqs, "startup_s": args.startup_s,
              "sync_s": args.sync_s, "slo": slo, "behaviour": behaviour.__dict__,
              "runs": runs}
    if args.plot:
        from folio.bench.autoscale_plot import plot_autoscale
        plot_autoscale(series, arrivals, slo["ttft_ms"] / 1000, args.plot,
                       max(t for t, _ in arrivals))
        result["plot"] = args.plot
    if not write_result(args, result):
        print(table(result))
    return 0


def table(result: dict) -> str:
    slo = result["slo"]
    lines = [f"{result['arrivals']} requests; objective TTFT <= {slo['ttft_ms']:g} ms and "
             f"TPOT <= {slo['tpot_ms']:g} ms; replicas ready {result['startup_s']:g} s after "
             f"they are asked for",
             "| policy | meets the objective | TTFT p50 / p99 (s) | TPOT p99 (ms) | "
             "replica-hours | replicas mean / max |", "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['policy']} | {r['slo_met']:.1%} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['tpot_p99_s'] * 1000:.0f} | "
                     f"{r['replica_hours']:.2f} | {r['mean_replicas']:.1f} / "
                     f"{r['max_replicas']} |")
    return "\n".join(lines)

