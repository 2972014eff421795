"""`folio bench autoscale`: the simulator's arithmetic on cases small enough to
follow by hand (service times, queueing, the HPA formula, its stabilization
and rate limits, start-up delay, routing), and the command end to end."""

import json
import math

import pytest
import yaml

from folio.bench.autoscale import (Autoscaler, Behaviour, Policy, ServiceCurve, hpa_desired,
                                   replica_hours, simulate)
from folio.bench.autoscale_cli import CHART_DEFAULTS, chart_settings
from folio.cli import main
from tests.deploy.manifests import CHART

FLAT = ServiceCurve((1.0,), (0.5,), (0.1,))          # TTFT 0.5 s and TPOT 0.1 s at any load
SLOW = ServiceCurve((1.0,), (1.0,), (1.0,))          # 1 s each: a 60-token request takes 60 s


def run(curve, arrivals, policy, max_num_seqs=1, startup_s=0.0, **kw):
    behaviour = kw.pop("behaviour", Behaviour())
    return simulate(curve, arrivals, policy, behaviour, max_num_seqs, startup_s, **kw)


def test_a_curve_from_a_sweep_uses_littles_law_and_interpolates():
    sweep = {"runs": [
        {"request_rate": 1.0, "completed": 10, "failed": 0, "request_throughput": 1.0,
         "e2e_ms": {"mean": 2000.0}, "ttft_ms": {"median": 100.0}, "tpot_ms": {"median": 10.0}},
        {"request_rate": 4.0, "completed": 10, "failed": 0, "request_throughput": 2.0,
         "e2e_ms": {"mean": 3000.0}, "ttft_ms": {"median": 300.0}, "tpot_ms": {"median": 40.0}},
        {"request_rate": float("inf"), "completed": 10, "failed": 0, "request_throughput": 9.0,
         "e2e_ms": {"mean": 9000.0}, "ttft_ms": {"median": 5000.0},
         "tpot_ms": {"median": 90.0}}]}
    curve = ServiceCurve.from_sweep(sweep)
    assert curve.concurrency == (2.0, 6.0)                 # 1 x 2 s, 2 x 3 s; inf left out
    assert curve.tpot(1.0) == 0.010                        # below the first point: the first
    assert curve.tpot(4.0) == pytest.approx(0.025)         # halfway between 10 and 40 ms
    assert curve.ttft(4.0) == pytest.approx(0.200)
    assert curve.tpot(12.0) == pytest.approx(0.080)        # past the last: 40 ms x 12 / 6
    with pytest.raises(ValueError, match="no finite-rate run"):
        ServiceCurve.from_sweep({"runs": [sweep["runs"][2]]})


def test_one_replica_serves_in_order_and_queues_past_max_num_seqs():
    requests, pool, _ = run(FLAT, [(0.0, 11), (0.0, 11)], Policy("f", "fixed", replicas=1))
    first, second = requests
    # 0.5 s to the first token, 10 more tokens at 0.1 s
    assert (first.first_token, first.finish) == (0.5, pytest.approx(1.5))
    assert (first.ttft, first.tpot) == (0.5, pytest.approx(0.1))
    # one sequence at a time: the second starts when the first ends
    assert second.ttft == pytest.approx(2.0) and second.finish == pytest.approx(3.0)
    assert replica_hours(pool) * 3600 == pytest.approx(3.0)


def test_two_sequences_at_once_share_the_replica_at_the_curves_pace():
    curve = ServiceCurve((1.0, 2.0), (0.5, 0.5), (0.1, 0.2))
    requests, _, _ = run(curve, [(0.0, 11), (0.0, 11)], Policy("f", "fixed", replicas=1),
                         max_num_seqs=2)
    for r in requests:        # both run: 0.5 s, then 10 tokens at 0.2 s (two running)
        assert r.ttft == 0.5 and r.finish == pytest.approx(2.5)


def test_the_hpa_formula():
    assert hpa_desired(1, [10.0], 2.0) == 5                       # ceil(1 x 10 / 2)
    assert hpa_desired(3, [3.0, 2.0, 2.0], 2.0) == 4              # ceil(3 x 2.33 / 2)
    assert hpa_desired(4, [2.1] * 4, 2.0) == 4                    # within 10 %: no change
    assert hpa_desired(4, [0.0] * 4, 2.0) == 0                    # clamped to min later
    # two pods still starting count as 0 to scale up: ceil(3 x (6 / 3) / 2) = 3
    assert hpa_desired(3, [6.0], 2.0, missing=2) == 3
    # ... and as the target to scale down: (0 + 2 + 2) / 3 / 2 = 0.67 -> ceil(0.67 x 3) = 2
    assert hpa_desired(3, [0.0], 2.0, missing=2) == 2
    # missing pods that bring the ratio within the tolerance: no change
    assert hpa_desired(3, [3.2], 1.0, missing=2) == 3


def test_the_autoscaler_limits_and_stabilizes_as_the_behaviour_says():
    a = Autoscaler(Behaviour(min_replicas=1, max_replicas=8, up_pods=2, up_period_s=60,
                             down_window_s=300, down_pods=1, down_period_s=120))
    assert a.decide(0, 1, 20) == 3          # 20 -> max 8, then at most 2 more per 60 s
    assert a.decide(15, 3, 20) == 3         # the 2 of t=0 are inside the period
    assert a.decide(60, 3, 20) == 5         # t=0 has left the period (60 s, exclusive)
    assert a.decide(75, 5, 1) == 5          # down: the window's highest (8) holds it
    assert a.decide(361, 5, 1) == 4         # all of the window says 1: down 1 per 120 s
    assert a.decide(376, 4, 1) == 4
    assert a.decide(481, 4, 1) == 3
    assert a.decide(496, 3, 0) == 3         # 0 is clamped to min 1, still rate-limited


def test_queue_keyed_scaling_starts_replicas_late_and_never_moves_a_waiting_request():
    # 7 requests of 60 s each at t=0 on one sequence at a time; sync 15 s, start-up 30 s
    arrivals = [(0.0, 60)] * 7
    requests, pool, trace = run(SLOW, arrivals, Policy("q", "queue", target=2.0),
                                startup_s=30.0)
    # t=15: 6 waiting on the one pod -> ceil(1 x 6 / 2) = 3 (2 added); their readiness at 45
    assert trace.times[:3] == [15.0, 30.0, 45.0]
    assert trace.replicas[:3] == [1, 3, 3] and trace.ready[:3] == [1, 1, 3]
    assert [len(p.waiting) for p in pool[1:3]] == [0, 0]      # nothing moved to them
    # so the seventh request still waits for the six before it: 6 x 60 s, then 1 s
    assert requests[-1].ttft == pytest.approx(361.0)
    assert max(r.finish for r in requests) == pytest.approx(420.0)


def test_utilization_is_the_busy_share_of_the_last_sync_period():
    # one request busy for 7.5 s (0.5 + 7 tokens x 1 s) of the first 15 s: reading 0.5
    arrivals = [(0.0, 8), (40.0, 2)]          # the second keeps the run going past t=30
    curve = ServiceCurve((1.0,), (0.5,), (1.0,))
    _, _, trace = run(curve, arrivals, Policy("u", "utilization", target=0.25))
    assert trace.replicas[:2] == [1, 2]       # ceil(1 x 0.5 / 0.25) = 2 after the first sync


def test_least_outstanding_routing_avoids_the_busy_replica():
    # A (long) at 0 s, B (short) at 1 s, C (short) at 10 s, two replicas, one sequence each
    arrivals = [(0.0, 200), (1.0, 2), (10.0, 2)]
    fixed = Policy("f", "fixed", replicas=2)
    rr, _, _ = run(FLAT, arrivals, fixed)
    lo, _, _ = run(FLAT, arrivals, fixed, routing="least-outstanding")
    # round-robin sends C behind A (0.5 + 199 x 0.1 = 20.4 s); least-outstanding to the idle one
    assert rr[2].ttft == pytest.approx(20.4 - 10.0 + 0.5)
    assert lo[2].ttft == pytest.approx(0.5)
    with pytest.raises(ValueError, match="routing must be"):
        run(FLAT, arrivals, fixed, routing="random")


def test_a_partial_values_file_is_merged_over_the_charts(tmp_path):
    partial = tmp_path / "values.yaml"
    partial.write_text("autoscaling:\n  maxReplicas: 20\n  scaleUp:\n    pods: 4\n")
    behaviour, target, seqs = chart_settings(partial)
    assert (behaviour.max_replicas, behaviour.up_pods, behaviour.up_period_s) == (20, 4, 60.0)
    assert (target, seqs, behaviour.down_window_s) == (2.0, 16, 300.0)


def test_the_commands_defaults_are_the_charts_values():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart_settings(CHART / "values.yaml") == chart_settings(None)
    assert values["maxNumSeqs"] == CHART_DEFAULTS["maxNumSeqs"]
    for key, value in CHART_DEFAULTS["autoscaling"].items():
        assert values["autoscaling"][key] == value


def test_bench_autoscale_end_to_end(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"runs": [
        {"request_rate": 1.0, "completed": 5, "failed": 0, "request_throughput": 1.0,
         "e2e_ms": {"mean": 1000.0}, "ttft_ms": {"median": 200.0},
         "tpot_ms": {"median": 20.0}}]}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"time": i * 0.5, "output_len": 20}) + "\n"
                             for i in range(200)))
    plot, saved = tmp_path / "autoscale.png", tmp_path / "result.json"
    assert main(["bench", "autoscale", "--service-curve", str(sweep), "--trace-file", str(trace),
                 "--plot", str(plot), "--save-result", str(saved), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(saved.read_text()) and plot.stat().st_size > 10_000
    names = [r["policy"] for r in result["runs"]]
    assert names == ["fixed 3", "fixed 6", "HPA on queue (target 2 waiting)",
                     "HPA on utilization (target 60%)", "HPA on utilization (target 95%)"]
    fixed3 = result["runs"][0]
    # 2 req/s of 0.2 + 19 x 0.02 = 0.58 s each: no queue; 3 replicas for the whole run
    assert fixed3["slo_met"] == 1.0 and fixed3["ttft_p99_s"] == pytest.approx(0.2)
    last = 199 * 0.5 + 0.58
    assert fixed3["replica_hours"] == pytest.approx(3 * math.ceil(last / 0.1) * 0.1 / 3600)
    assert result["arrivals"] == 200 and result["max_num_seqs"] == 16


@pytest.mark.parametrize("line, message", [
    ('{"time": 1}', "expected"), ("not json", "expected"), ("", "holds no arrival")])
def test_a_bad_trace_file_is_one_clear_error(tmp_path, capsys, line, message):
    sweep = tmp_path / "s.json"
    sweep.write_text(json.dumps({"runs": []}))
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    curve = tmp_path / "c.json"
    curve.write_text(json.dumps({"runs": [
        {"request_rate": 1.0, "completed": 5, "failed": 0, "request_throughput": 1.0,
         "e2e_ms": {"mean": 1000.0}, "ttft_ms": {"median": 200.0},
         "tpot_ms": {"median": 20.0}}]}))
    assert main(["bench", "autoscale", "--service-curve", str(curve),
                 "--trace-file", str(trace)]) != 0
    assert message in capsys.readouterr().err
    assert main(["bench", "autoscale", "--service-curve", str(sweep)]) != 0
    assert "no finite-rate run" in capsys.readouterr().err


@pytest.mark.parametrize("autoscaling, message", [
    ({"minReplicas": 0}, "minReplicas must be at least 1"),
    ({"minReplicas": 4, "maxReplicas": 2}, "maxReplicas must be at least")])
def test_impossible_bounds_are_refused_as_the_chart_refuses_them(tmp_path, autoscaling, message):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"autoscaling": autoscaling}))
    with pytest.raises(ValueError, match=message):      # minReplicas 0 simulated forever
        chart_settings(values)
