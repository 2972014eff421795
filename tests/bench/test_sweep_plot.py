"""The sweep plot: a numeric rate axis with 'inf' apart, y-axes from zero, every
panel, and a re-plot from a saved result."""

import json
import math

import pytest

from folio.bench.sweep_plot import (PANELS, check_plottable, rate_positions, sweep_figure)
from folio.cli import main

pytest.importorskip("matplotlib")


def run(rate, scale: float) -> dict:
    """A summary as `summarize` saves it, its figures growing with `scale`."""
    def stats(ms):
        return {"mean": ms * 1.1, "median": ms, "p99": ms * 2}
    return {"request_rate": rate, "completed": 8, "failed": 0, "seconds": 4.0,
            "request_throughput": 0.9 * scale, "output_throughput": 80.0 * scale,
            "total_token_throughput": 200.0 * scale, "ttft_ms": stats(90 + scale),
            "tpot_ms": stats(11 + scale), "itl_ms": stats(10 + scale),
            "e2e_ms": stats(900 + 10 * scale), "errors": [], "goodput": 0.8 * scale}


SWEEP = [run(0.5, 0.5), run(1.0, 1), run(4.0, 3), run("inf", 5)]


def test_rates_sit_at_their_value_and_inf_past_a_break():
    xs, break_x = rate_positions([0.5, 1.0, 4.0, "inf"])
    assert xs[:3] == [0.5, 1.0, 4.0]               # numeric, not 0, 1, 2
    assert 4.0 < break_x < xs[3] and math.isfinite(xs[3])
    # the order of the sweep does not matter, and repeated infs share one point
    xs, break_x = rate_positions(["inf", 2.0, float("inf")])
    assert xs[0] == xs[2] > break_x > 2.0 == xs[1]


def test_no_break_without_inf_or_without_finite_rates():
    assert rate_positions([1.0, 2.0]) == ([1.0, 2.0], None)
    xs, break_x = rate_positions(["inf"])
    assert break_x is None and math.isfinite(xs[0]) and xs[0] > 0


def test_every_panel_starts_at_zero_with_numeric_rates():
    fig = sweep_figure(SWEEP, "synthetic")
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == [p[1] for p in PANELS]
    assert "TTFT (ms)" in [ax.get_ylabel() for ax in axes]
    xs, break_x = rate_positions([r["request_rate"] for r in SWEEP])
    for ax in axes:
        assert ax.get_ylim()[0] == 0, ax.get_ylabel()
        assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] > xs[-1]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels[:3] == ["0.5", "1", "4"] and "inf" in labels[3]
        for line in ax.get_lines():
            assert all(isinstance(float(x), float) for x in line.get_xdata())
    ttft = axes[2]
    p50 = next(line for line in ttft.get_lines() if line.get_label() == "p50")
    assert list(p50.get_xdata()) == [0.5, 1.0, 4.0]       # the inf point is not joined
    assert list(p50.get_ydata()) == [90.5, 91, 93]
    e2e_points = [y for line in axes[4].get_lines() for y in line.get_ydata()]
    assert max(e2e_points) == pytest.approx(2 * 0.95)     # p99 of 950 ms, drawn in seconds


def test_the_request_panel_shows_the_offered_rate_and_goodput():
    labels = [line.get_label() for line in sweep_figure(SWEEP, "t").axes[0].get_lines()]
    assert {"completed", "offered rate", "goodput (within the SLO)"} <= set(labels)
    offered = next(line for line in sweep_figure(SWEEP, "t").axes[0].get_lines()
                   if line.get_label() == "offered rate")
    assert list(offered.get_xdata()) == [0, 4.0] and list(offered.get_ydata()) == [0, 4.0]


def test_a_missing_latency_is_a_gap_not_a_crash(tmp_path):
    sweep = [run(1.0, 1), run("inf", 2)]
    sweep[0]["tpot_ms"] = {"mean": None, "median": None, "p99": None}   # 1-token outputs
    from folio.bench.sweep_plot import plot_sweep
    plot_sweep(sweep, str(tmp_path / "gap.png"), "gap")
    assert (tmp_path / "gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_from_a_saved_result(tmp_path, capsys):
    saved, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    saved.write_text(json.dumps({"model": "m", "endpoint": "/v1/completions", "num_prompts": 8,
                                 "input_len": "4:8", "output_len": "3", "runs": SWEEP}))
    assert main(["bench", "serve", "--from-result", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4 runs" in capsys.readouterr().out


def test_a_saved_result_without_the_figures_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"request_rate": 1.0, "completed": 3}]}))
    assert main(["bench", "serve", "--from-result", str(bad),
                 "--plot", str(tmp_path / "x.png")]) != 0
    assert "run 0 of the saved result lacks e2e_ms" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no runs"):
        check_plottable({"model": "m"})
