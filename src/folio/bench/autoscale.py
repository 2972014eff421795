"""`folio bench autoscale`: a replica pool simulated on Folio's measured service
curve, under three scaling policies.

The model, all of it stated here so that a figure can be checked by hand:

- **A replica** runs at most `max_num_seqs` requests at once; the rest wait in
  its own queue (Folio's waiting queue, what `folio:num_requests_waiting`
  reports), first come first served. A request admitted while n requests run
  (itself included) has its first token after `curve.ttft(n)` seconds, then
  gains one output token every `curve.tpot(n)` seconds, n re-read every tick.
- **The service curve** comes from a `folio bench serve --sweep-rates` result:
  each finite-rate run gives the mean concurrency (Little's law: completed
  req/s x mean E2E), with that run's median TTFT and TPOT. Between points the
  curve is linear; below the first it is the first point; past the last the
  replica's token rate stays where it was (TTFT and TPOT grow as n / n_last).
- **Routing** is round-robin over the ready replicas that are not draining,
  as a Kubernetes Service spreads connections, or to the replica with the
  fewest requests in flight (`least-outstanding`: a least-request load
  balancer in front); a request never moves to another replica once sent.
- **A new replica** is ready `startup_s` after the autoscaler asks for it
  (scheduling, image, model load). **A removed replica** takes no new request,
  finishes what it holds (Folio drains on SIGTERM), then stops. Replica-hours
  count every replica from its request to its stop.
- **The autoscaler** is the HPA algorithm (autoscaling/v2), every `sync_s`:
  desired = ceil(current x average / target) over the ready pods' readings,
  untouched within a 10 % tolerance; pods still starting count as 0 when
  scaling up and as the target when scaling down, as the HPA treats pods
  without metrics; a scale-down takes the highest recommendation of the last
  stabilization window; at most `up_pods` added per `up_period_s` and
  `down_pods` removed per `down_period_s`; clamped to [min, max].
- **The policies**: fixed replicas; the HPA on the waiting queue (a reading
  is the pod's queue length at the sync); the HPA on utilization (a reading
  is the share of the last sync period in which the pod ran at least one
  request, which is what GPU utilization reports for a continuously batched
  server).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

TOLERANCE = 0.1
ROUTINGS = ("round-robin", "least-outstanding")


@dataclass(frozen=True)
class ServiceCurve:
    concurrency: tuple[float, ...]
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]

    def __post_init__(self):
        n = self.concurrency
        if not (len(n) == len(self.ttft_s) == len(self.tpot_s) >= 1):
            raise ValueError("a service curve needs at least one point, each with TTFT and TPOT")
        if any(b <= a for a, b in zip(n, n[1:])) or n[0] <= 0:
            raise ValueError(f"the curve's concurrencies must rise from above 0, got {n}")
        if min(self.ttft_s + self.tpot_s) <= 0:
            raise ValueError("the curve's TTFT and TPOT must be > 0")

    @classmethod
    def from_sweep(cls, result: dict) -> "ServiceCurve":
        """From a saved `folio bench serve --sweep-rates` result (its finite rates)."""
        points = {}
        for run in result.get("runs", []):
            rate, done = run.get("request_rate"), run.get("completed", 0)
            if rate is None or math.isinf(float(rate)) or not done or run.get("failed"):
                continue
            tpot = run["tpot_ms"]["median"]
            if tpot is None:
                continue
            n = run["request_throughput"] * run["e2e_ms"]["mean"] / 1000.0
            points[round(n, 6)] = (run["ttft_ms"]["median"] / 1000.0, tpot / 1000.0)
        if not points:
            raise ValueError("the sweep has no finite-rate run that completed requests: run "
                             "folio bench serve --sweep-rates with rates such as 0.5,1,2,4")
        ns = sorted(points)
        return cls(tuple(ns), tuple(points[n][0] for n in ns), tuple(points[n][1] for n in ns))

    def _at(self, values: tuple[float, ...], n: float) -> float:
        xs = self.concurrency
        if n <= xs[0]:
            return values[0]
        if n >= xs[-1]:
            return values[-1] * n / xs[-1]          # the token rate saturates
        i = bisect_right(xs, n)
        a, b = xs[i - 1], xs[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (n - a) / (b - a)

    def ttft(self, n: float) -> float:
        return self._at(self.ttft_s, n)

    def tpot(self, n: float) -> float:
        return self._at(self.tpot_s, n)


@dataclass
class SimRequest:
    arrival: float
    output_len: int
    first_token: Optional[float] = None
    finish: Optional[float] = None
    tokens: float = 0.0             # output tokens after the first

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / max(1, self.output_len - 1)


@dataclass
class Replica:
    asked: float                    # when the autoscaler asked for it
    ready_at: float
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    draining: bool = False
    stopped: Optional[float] = None
    busy_s: float = 0.0             # time with a request running, since the last sync

    def ready(self, t: float) -> bool:
        return t >= self.ready_at and self.stopped is None


@dataclass(frozen=True)
class Behaviour:
    """The HPA's bounds and behaviour: the chart's autoscaling values."""
    min_replicas: int = 1
    max_replicas: int = 8
    up_window_s: float = 0.0
    up_pods: int = 2
    up_period_s: float = 60.0
    down_window_s: float = 300.0
    down_pods: int = 1
    down_period_s: float = 120.0

    def __post_init__(self):
        # as the chart's folio.checkValues: with no pod, nothing would ever scale up
        if self.min_replicas < 1:
            raise ValueError("autoscaling.minReplicas must be at least 1: the waiting queue "
                             "is empty when no pod runs, so it cannot scale from zero")
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.maxReplicas must be at least autoscaling.minReplicas")


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str                       # fixed, queue or utilization
    replicas: int = 1               # fixed
    target: float = 2.0             # waiting requests per pod, or a busy share (0-1)


def hpa_desired(current: int, readings: list[float], target: float, missing: int = 0,
                tolerance: float = TOLERANCE) -> int:
    """The HPA's replica count for a Pods metric with an AverageValue target:
    ceil(current x average / target) over the pods that report, `missing` pods
    (not ready) counted as 0 to scale up and as the target to scale down, no
    change within the tolerance (or when the missing pods reverse the
    direction)."""
    if not readings:
        return current
    ratio = sum(readings) / len(readings) / target
    if missing:
        fill = 0.0 if ratio > 1 else target
        new = (sum(readings) + missing * fill) / (len(readings) + missing) / target
        if abs(new - 1) <= tolerance or (new > 1) != (ratio > 1):
            return current
        return math.ceil(new * (len(readings) + missing))
    if abs(ratio - 1) <= tolerance:
        return current
    return math.ceil(ratio * len(readings))


class Autoscaler:
    """Recommendation, stabilization and rate limits of the HPA, for one target."""

    def __init__(self, behaviour: Behaviour):
        self.b = behaviour
        self.recommendations: list[tuple[float, int]] = []
        self.changes: list[tuple[float, int]] = []      # (time, +added / -removed)

    def decide(self, t: float, current: int, raw: int) -> int:
        b = self.b
        raw = min(b.max_replicas, max(b.min_replicas, raw))
        self.recommendations.append((t, raw))
        keep = max(b.up_window_s, b.down_window_s)
        self.recommendations = [(s, r) for s, r in self.recommendations if s >= t - keep]
        # the windows hold the recommendations of the last W seconds, this one included
        up = min(r for s, r in self.recommendations if s > t - b.up_window_s or s == t)
        down = max(r for s, r in self.recommendations if s > t - b.down_window_s or s == t)
        desired = current
        if up > current:
            added = sum(c for s, c in self.changes if c > 0 and s > t - b.up_period_s)
            desired = min(up, current + max(0, b.up_pods - added))
        elif down < current:
            removed = -sum(c for s, c in self.changes if c < 0 and s > t - b.down_period_s)
            desired = max(down, current - max(0, b.down_pods - removed))
        if desired != current:
            self.changes.append((t, desired - current))
        return desired


@dataclass
class Trace:
    times: list[float]              # series sampled every sync
    replicas: list[int]
    ready: list[int]
    waiting: list[int]


def simulate(curve: ServiceCurve, arrivals: list[tuple[float, int]], policy: Policy,
             behaviour: Behaviour, max_num_seqs: int, startup_s: float, sync_s: float = 15.0,
             tick_s: float = 0.1, routing: str = "round-robin",
             ) -> tuple[list[SimRequest], list[Replica], Trace]:
    """Run `arrivals` ((time, output tokens), sorted) through the pool until every
    request has finished. Returns the requests, every replica that ever existed,
    and the pool's state at each sync."""
    if max_num_seqs < 1 or tick_s <= 0 or sync_s < tick_s:
        raise ValueError("max_num_seqs must be >= 1 and 0 < tick_s <= sync_s")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
    start = policy.replicas if policy.kind == "fixed" else behaviour.min_replicas
    pool = [Replica(asked=0.0, ready_at=0.0) for _ in range(start)]
    scaler = Autoscaler(behaviour)
    requests = [SimRequest(a, max(1, n)) for a, n in arrivals]
    trace = Trace([], [], [], [])
    nxt, rr, step = 0, 0, 0
    sync_every = max(1, round(sync_s / tick_s))
    while True:
        t = step * tick_s
        # arrivals in [t, t + tick) go to a ready replica that is not draining
        live = None
        while nxt < len(requests) and requests[nxt].arrival < t + tick_s:
            live = live or [r for r in pool if r.ready(t) and not r.draining]
            if not live:                         # none ready yet: it waits at the Service
                break
            if routing == "round-robin":
                target = live[rr % len(live)]
            else:                                # the fewest requests in flight
                target = min(live, key=lambda r: len(r.waiting) + len(r.running))
            target.waiting.append(requests[nxt])
            rr += 1
            nxt += 1
        for rep in pool:
            if rep.ready(t):
                _advance(rep, curve, max_num_seqs, t, tick_s)
                if rep.draining and not rep.waiting and not rep.running:
                    rep.stopped = t + tick_s
        step += 1
        if step % sync_every == 0:
            now = step * tick_s
            alive = [r for r in pool if r.stopped is None and not r.draining]
            _record(trace, now, pool, alive)
            if policy.kind != "fixed":
                _scale(pool, alive, scaler, policy, now, sync_s, startup_s)
            for rep in pool:
                rep.busy_s = 0.0
        if nxt == len(requests) and not any(r.waiting or r.running for r in pool):
            break
    for rep in pool:
        if rep.stopped is None:
            rep.stopped = step * tick_s
    return requests, pool, trace


def _advance(rep: Replica, curve: ServiceCurve, max_num_seqs: int, t: float, dt: float) -> None:
    _admit(rep, curve, max_num_seqs, t)
    if not rep.running:
        return
    rate = 1.0 / curve.tpot(len(rep.running))      # output tokens per second, each
    end = t + dt
    still, freed = [], []
    for req in rep.running:
        begin = max(t, req.first_token)            # decoding starts after the first token
        if begin >= end:
            still.append(req)
            continue
        need = req.output_len - 1
        if req.tokens + rate * (end - begin) >= need - 1e-9:
            req.finish = begin + (need - req.tokens) / rate
            req.tokens = need
            freed.append(req.finish)
        else:
            req.tokens += rate * (end - begin)
            still.append(req)
    rep.running = still
    for when in sorted(freed):                     # a freed slot is taken when it frees
        _admit(rep, curve, max_num_seqs, when)
    # busy until the last request ends, if the replica empties within this tick
    rep.busy_s += dt if rep.running else max(freed) - t


def _admit(rep: Replica, curve: ServiceCurve, max_num_seqs: int, t: float) -> None:
    while rep.waiting and len(rep.running) < max_num_seqs:
        req = rep.waiting.popleft()
        req.first_token = max(t, req.arrival) + curve.ttft(len(rep.running) + 1)
        rep.running.append(req)


def _record(trace: Trace, now: float, pool: list[Replica], alive: list[Replica]) -> None:
    trace.times.append(now)
    trace.replicas.append(sum(1 for r in pool if r.stopped is None))
    trace.ready.append(sum(1 for r in alive if r.ready(now)))
    trace.waiting.append(sum(len(r.waiting) for r in pool))


def _scale(pool, alive, scaler: Autoscaler, policy: Policy, now: float, sync_s: float,
           startup_s: float) -> None:
    ready = [r for r in alive if r.ready(now)]
    if policy.kind == "queue":
        readings = [float(len(r.waiting)) for r in ready]
    else:
        readings = [min(1.0, r.busy_s / sync_s) for r in ready]
    current = len(alive)
    raw = hpa_desired(current, readings, policy.target, missing=current - len(ready))
    desired = scaler.decide(now, current, raw)
    for _ in range(desired - current):
        pool.append(Replica(asked=now, ready_at=now + startup_s))
    if desired < current:
        # the not-yet-ready first, then the ready ones holding the least
        order = sorted(alive, key=lambda r: (r.ready(now), len(r.waiting) + len(r.running)))
        for rep in order[:current - desired]:
            rep.draining = True
            if not rep.ready(now):
                rep.stopped = now


def replica_hours(pool: list[Replica]) -> float:
    return sum(r.stopped - r.asked for r in pool) / 3600.0


def summarize(requests: list[SimRequest], pool: list[Replica], trace: Trace,
              ttft_slo_s: float, tpot_slo_s: float) -> dict:
    ttfts = sorted(r.ttft for r in requests)
    tpots = sorted(r.tpot for r in requests if r.output_len > 1)
    met = sum(1 for r in requests if r.ttft <= ttft_slo_s and
              (r.output_len <= 1 or r.tpot <= tpot_slo_s))

    def pct(values, p):
        return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else None

    return {"requests": len(requests), "slo_met": met / len(requests) if requests else None,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "tpot_p50_s": pct(tpots, 50), "tpot_p99_s": pct(tpots, 99),
            "replica_hours": replica_hours(pool),
            "max_replicas": max(trace.replicas, default=0),
            "mean_replicas": (sum(trace.replicas) / len(trace.replicas)
                              if trace.replicas else 0.0)}
