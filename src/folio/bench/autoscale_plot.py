"""The plot of `folio bench autoscale`: offered load, replicas, waiting requests
and TTFT over time, one line per policy, on one time axis. Headless (a bare
matplotlib Figure on the Agg canvas)."""

from __future__ import annotations

import os


def _per_minute(values: list[tuple[float, float]], stat) -> tuple[list[float], list[float]]:
    buckets: dict[int, list[float]] = {}
    for t, v in values:
        buckets.setdefault(int(t // 60), []).append(v)
    keys = sorted(buckets)
    return [k + 0.5 for k in keys], [stat(sorted(buckets[k])) for k in keys]


def plot_autoscale(series, arrivals, ttft_slo_s: float, path: str,
                   duration_s: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 11), layout="constrained")
    FigureCanvasAgg(fig)
    load, reps, wait, ttft = fig.subplots(4, 1, sharex=True)
    xs, ys = _per_minute([(t, 1.0) for t, _ in arrivals], lambda v: len(v) / 60.0)
    load.plot(xs, ys, color="0.3", drawstyle="steps-mid")
    load.set(title="Offered load", ylabel="requests/s (per minute)")
    for i, (name, requests, trace) in enumerate(series):
        colour, minutes = f"C{i}", [t / 60 for t in trace.times]
        reps.plot(minutes, trace.replicas, color=colour, label=name, drawstyle="steps-post")
        wait.plot(minutes, trace.waiting, color=colour, label=name)
        tx, ty = _per_minute([(r.arrival, r.ttft) for r in requests],
                             lambda v: v[min(len(v) - 1, int(0.9 * len(v)))])
        ttft.plot(tx, ty, color=colour, label=name)
    reps.set(title="Replicas (starting, ready and draining)", ylabel="replicas")
    wait.set(title="Requests waiting, all replicas (symmetric log scale)", ylabel="requests",
             yscale="symlog")
    ttft.axhline(ttft_slo_s, color="k", linestyle=":", label="TTFT objective")
    ttft.set(title="TTFT p90 of the requests arriving in each minute (log scale)",
             ylabel="seconds", xlabel="minutes", yscale="log")
    for ax in (load, reps, wait):
        ax.set_ylim(bottom=0)
    # what a policy still holds when the trace ends drains after it: not drawn
    load.set_xlim(0, duration_s / 60 * 1.02)
    reps.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ttft.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    for ax in (load, reps, wait, ttft):
        ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
