"""`folio bench host` runs end to end on a few steps, and its stand-in device
queues each step's time after what it was given before, as a stream does."""

import argparse
import math
import time

from folio.bench import host


def _args(*extra):
    p = argparse.ArgumentParser()
    host.add_host_args(p)
    return p.parse_args(["--batches", "1,3", "--delays", "1", "--steps", "3", "--rounds", "1",
                         *extra])


def test_the_benchmark_reports_each_batch_and_the_stand_in():
    for extra in ((), ("--async-scheduling",)):
        r = host.run(_args(*extra))
        assert r["async_scheduling"] == bool(extra) and r["device"] == "cpu"
        assert set(r["step_ms"]) == set(r["model_ms"]) == set(r["host_ms"]) == {"1", "3"}
        for b in ("1", "3"):
            # (each figure is the difference of two timed runs 3 steps apart: at
            # so few steps its sign is the machine's noise, not the code's)
            assert all(math.isfinite(r[k][b]) for k in ("step_ms", "model_ms", "host_ms"))
            assert math.isclose(r["host_ms"][b], r["step_ms"][b] - r["model_ms"][b],
                                abs_tol=1e-9)
        (s,) = r["stand_in"]
        assert s["batch"] == 3 and s["device_ms"] == 1.0 and s["period_ms"] > 0


class _Runner:
    def step_event(self):
        return None


class _Model:
    def forward(self):
        return "hidden"

    def compute_logits(self):
        return "logits"


def test_the_stand_in_queues_device_time_like_a_stream():
    runner, model = _Runner(), _Model()
    dev = host.StandInDevice(model, runner).install()
    dev.delay = 0.05
    assert model.forward() == "hidden" and model.compute_logits() == "logits"
    t0 = time.perf_counter()
    first, second = runner.step_event(), runner.step_event()   # two steps handed over
    assert time.perf_counter() - t0 < 0.02                      # neither waited
    assert second.at - first.at >= 0.05 - 1e-6                  # the second after the first
    second.synchronize()
    assert time.perf_counter() - t0 >= 0.1 - 1e-3
