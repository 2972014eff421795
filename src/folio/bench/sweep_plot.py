"""The plot of a `folio bench serve --sweep-rates` run, drawn to be read at a glance.

- The x-axis is numeric: a Poisson rate sits at its value, so 1, 2 and 4 req/s
  are not drawn evenly spaced. 'inf' (every request sent at once) is not a
  rate on that axis: it sits apart, past a dotted break, labelled.
- Every y-axis starts at zero, so a few milliseconds of noise does not look
  like a cliff.
- One panel each: requests completed per second (with the offered rate for
  reference), output tokens per second, TTFT, TPOT and ITL, E2E latency;
  latencies at p50 (solid) and p99 (dashed).

Headless: a bare matplotlib Figure on the Agg canvas, no pyplot and no display.
"""

from __future__ import annotations

import math
import os
from typing import Optional

INF = float("inf")

# (title, y label, [(summary key, stat or None, legend label, colour)], scale)
PANELS = [
    ("Requests completed", "requests/s",
     [("request_throughput", None, "completed", "C0")], 1.0),
    ("Output tokens", "output tokens/s",
     [("output_throughput", None, "output tokens", "C0")], 1.0),
    ("Time to first token", "TTFT (ms)",
     [("ttft_ms", "median", "p50", "C0"), ("ttft_ms", "p99", "p99", "C0")], 1.0),
    ("Time per output token, inter-token latency", "TPOT / ITL (ms)",
     [("tpot_ms", "median", "TPOT p50", "C0"), ("tpot_ms", "p99", "TPOT p99", "C0"),
      ("itl_ms", "median", "ITL p50", "C2"), ("itl_ms", "p99", "ITL p99", "C2")], 1.0),
    ("End-to-end latency", "E2E latency (s)",
     [("e2e_ms", "median", "p50", "C0"), ("e2e_ms", "p99", "p99", "C0")], 1e-3),
]
NEEDED = {"request_rate", "request_throughput", "output_throughput",
          "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


def as_rate(value) -> float:
    """A run's request_rate as saved (a number, or the string 'inf')."""
    return INF if value == "inf" else float(value)


def rate_positions(rates) -> tuple[list[float], Optional[float]]:
    """x of each rate, and x of the break before 'inf' (None without one).

    Finite rates sit at their value. Every 'inf' sits at one point past the
    largest finite rate, two gaps of a quarter of it beyond, the break
    half-way: far enough that it reads as "off the scale", not as the next
    step of the sweep.
    """
    values = [as_rate(r) for r in rates]
    finite = [v for v in values if v != INF]
    top = max(finite, default=0.0)
    gap = 0.25 * top if top else 1.0
    xs = [top + 2 * gap if v == INF else v for v in values]
    has_break = bool(finite) and len(finite) < len(values)
    return xs, (top + gap if has_break else None)


def _value(summary: dict, key: str, stat: Optional[str], scale: float) -> float:
    v = summary[key] if stat is None else summary[key][stat]
    return math.nan if v is None else v * scale


def _series(ax, xs, ys, infinite, label, colour, linestyle="-", marker="o", **extra) -> None:
    """Finite rates joined by a line in rate order; 'inf' a lone marker, unjoined."""
    style = {"color": colour, "marker": marker, "markersize": 5, **extra}
    pts = sorted((x, y) for x, y, i in zip(xs, ys, infinite) if not i)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=linestyle, label=label, **style)
    ax.plot([x for x, i in zip(xs, infinite) if i], [y for y, i in zip(ys, infinite) if i],
            linestyle="none", **style)


def _rate_axis(ax, rates, xs, break_x) -> None:
    ticks = sorted({(x, "all at once\n(inf)" if as_rate(r) == INF else f"{as_rate(r):g}")
                    for r, x in zip(rates, xs)})
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks])
    ax.set_xlim(0, max(xs) * 1.1 if xs else 1)
    if break_x is not None:
        ax.axvline(break_x, color="0.5", linestyle=":", linewidth=1.2)
    ax.set_xlabel("offered request rate (req/s)")


def _request_references(ax, summaries, xs, infinite) -> None:
    """The offered rate (what completed would be if the server kept pace) and,
    with an SLO, the goodput."""
    finite = [x for x, i in zip(xs, infinite) if not i]
    if finite:
        ax.plot([0, max(finite)], [0, max(finite)], color="0.6", linestyle="--", linewidth=1,
                label="offered rate")
    if any("goodput" in s for s in summaries):
        # Hollow and larger: where every request met the SLO it sits on "completed".
        _series(ax, xs, [s.get("goodput", math.nan) for s in summaries], infinite,
                "goodput (within the SLO)", "C3", linestyle=":", marker="D",
                markersize=9, markerfacecolor="none")


def _panel(ax, summaries, xs, infinite, spec) -> None:
    title, ylabel, series, scale = spec
    for key, stat, label, colour in series:
        ys = [_value(s, key, stat, scale) for s in summaries]
        p99 = stat == "p99"
        _series(ax, xs, ys, infinite, label, colour, "--" if p99 else "-", "s" if p99 else "o")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def sweep_figure(summaries: list[dict], title: str):
    """The Figure of a sweep: five panels against the offered rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    rates = [s["request_rate"] for s in summaries]
    xs, break_x = rate_positions(rates)
    infinite = [as_rate(r) == INF for r in rates]
    fig = Figure(figsize=(14, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 6)
    cells = [grid[0, 0:3], grid[0, 3:6], grid[1, 0:2], grid[1, 2:4], grid[1, 4:6]]
    for i, (cell, spec) in enumerate(zip(cells, PANELS)):
        ax = fig.add_subplot(cell)
        _panel(ax, summaries, xs, infinite, spec)
        if i == 0:
            _request_references(ax, summaries, xs, infinite)
        _rate_axis(ax, rates, xs, break_x)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{title}\nPoisson arrivals at each offered rate; 'all at once' sends every "
                 f"request at t = 0 (right of the dotted break)", fontsize=11)
    return fig


def plot_sweep(summaries: list[dict], path: str, title: str) -> None:
    """Write the sweep's plot to `path` (PNG unless the name says otherwise)."""
    # A name without a suffix (/dev/null) would leave matplotlib guessing.
    fmt = None if os.path.splitext(path)[1] else "png"
    sweep_figure(summaries, title).savefig(path, dpi=110, format=fmt)


def check_plottable(result: dict) -> list[dict]:
    """The runs of a saved result, or a ValueError that says what is missing."""
    runs = result.get("runs") if isinstance(result, dict) else None
    if not runs:
        raise ValueError("the saved result holds no runs to plot")
    for i, run in enumerate(runs):
        missing = NEEDED - set(run)
        if missing:
            raise ValueError(f"run {i} of the saved result lacks {', '.join(sorted(missing))}")
    return runs
