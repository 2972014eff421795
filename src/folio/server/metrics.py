"""Prometheus metrics, named as vLLM's under `folio:` and labelled `model_name`;
the ones vLLM also has are served under its `vllm:` names too (VLLM_NAMES: the
same samples, so the same units and meaning), for the routers, dashboards and
the Gateway API inference extension that read those.

One registry per app (never the global one), updated from the engine thread
after every step from the engine's StepStats message (the server never reads
the scheduler). `folio:num_requests_waiting` is the queue length to autoscale
on. Every `log_interval` seconds of steps a line of the same numbers goes to
the log (throughput, queue, KV usage, prefix hits, speculative acceptance).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from folio.core.spec_decode import SpecDecodeCounts
from folio.engine.protocol import StepStats
from folio.outputs import RequestOutput

logger = logging.getLogger("folio")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# folio:<name> series that vLLM serves as vllm:<name>, with the same meaning
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
              "prefix_cache_hits", "request_success", "time_to_first_token_seconds",
              "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "spec_decode_num_drafts",
              "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str, cost=None, log_interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"folio:{name}", doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"folio:{name}", doc, label, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"folio:{name}", doc, label, buckets=buckets,
                             registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "Fraction (0-1) of KV blocks held by some sequence.")
        self.kv_waste = gauge("kv_cache_waste_perc",
                              "Fraction (0-1) of the slots in held blocks that hold no token.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.cache_queries = counter("prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._cache_seen = (0, 0)
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Speculative decoding: decode steps that carried proposals.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Speculative decoding: tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Speculative decoding: proposed tokens accepted.")
        self.spec_rate = gauge("spec_decode_acceptance_rate",
                               "Speculative decoding: accepted over proposed tokens, since start.")
        self.spec_length = gauge("spec_decode_mean_accepted_length",
                                 "Speculative decoding: tokens a step with proposals yields per "
                                 "sequence (1 + accepted per proposal run), since start.")
        self._spec_seen = SpecDecodeCounts()
        self.engine_steps = counter("engine_steps", "Engine steps run.")
        self.engine_busy = counter("engine_busy_seconds",
                                   "Seconds the engine had requests to run: from a busy spell's "
                                   "first step to the end of its last, the work between steps "
                                   "included (engine_steps / engine_busy_seconds: the step rate; "
                                   "its rate over time: the engine's duty cycle).")
        self._engine_seen = (0, 0.0)
        self.success = Counter("folio:request_success", "Finished requests by reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduling.", _REQUEST_BUCKETS)
        tenant = ["model_name", "tenant", "adapter"]     # adapter: '' for the base model
        self.tenant_prompt = Counter("folio:tenant_prompt_tokens", "Prompt tokens by tenant.",
                                     tenant, registry=r)
        self.tenant_generation = Counter("folio:tenant_generation_tokens",
                                         "Generated tokens by tenant.", tenant, registry=r)
        self.tenant_requests = Counter("folio:tenant_requests", "Finished requests by tenant "
                                       "and reason.", [*tenant, "finished_reason"], registry=r)
        self.cost = cost            # server/cost.py's CostMeter, with --cost-per-hour
        if cost is not None:
            per_1k = Gauge("folio:cost_per_1k_tokens", "Dollars per 1,000 tokens over the "
                           "last 5 minutes (--cost-per-hour), prompt and output.",
                           ["model_name", "kind"], registry=r)
            per_1k.labels(model_name, "prompt").set_function(lambda: cost.per_1k()[0])
            per_1k.labels(model_name, "output").set_function(lambda: cost.per_1k()[1])
        self.model_name = model_name
        self._seen: dict[str, tuple[int, float]] = {}   # request id -> (tokens, last time)
        self._preemptions_seen = 0
        self.log_interval, self._clock = log_interval, clock
        self._log_from: Optional[tuple[float, int, int, int, int]] = None
        self._tokens = [0, 0]            # prompt and output tokens, since start

    def on_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step: gauges set, the totals' growth counted."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_waste.set(stats.kv_cache_waste)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.cache_queries.inc(max(0, queries - self._cache_seen[0]))
        self.cache_hits.inc(max(0, hits - self._cache_seen[1]))
        self._cache_seen = (queries, hits)
        spec = stats.spec
        for metric, grown in zip((self.spec_drafts, self.spec_draft_tokens,
                                  self.spec_accepted), spec.since(self._spec_seen)):
            metric.inc(max(0, grown))
        self._spec_seen = spec
        self.engine_steps.inc(max(0, stats.num_steps - self._engine_seen[0]))
        self.engine_busy.inc(max(0.0, stats.busy_seconds - self._engine_seen[1]))
        self._engine_seen = (stats.num_steps, stats.busy_seconds)
        if spec.draft_tokens:
            self.spec_rate.set(spec.acceptance_rate)
            self.spec_length.set(spec.mean_accepted_length)
        step = [0, 0]                    # the step's new prompt and output tokens
        for out in outputs:
            self._on_output(out, step)
        if self.cost is not None:
            self.cost.add(*step)
        self._tokens[0] += step[0]
        self._tokens[1] += step[1]
        self._maybe_log(stats)

    def _maybe_log(self, stats: StepStats) -> None:
        """Every log_interval seconds: the interval's throughput and the state now."""
        now = self._clock()
        mark = (now, *self._tokens, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        if self._log_from is None:
            self._log_from = mark
            return
        elapsed = now - self._log_from[0]
        if elapsed < self.log_interval:
            return
        prompt, output, drafted, accepted = (a - b for a, b in zip(mark[1:], self._log_from[1:]))
        self._log_from = mark
        hits = stats.prefix_cache_hits / stats.prefix_cache_queries \
            if stats.prefix_cache_queries else 0.0
        line = (f"prompt throughput {prompt / elapsed:.1f} tok/s, generation throughput "
                f"{output / elapsed:.1f} tok/s, running {stats.num_running}, waiting "
                f"{stats.num_waiting}, KV cache usage {100 * stats.kv_cache_usage:.1f}%, "
                f"prefix cache hit rate {100 * hits:.1f}%")
        if drafted:
            line += (f", speculative acceptance {100 * accepted / drafted:.1f}% "
                     f"({accepted} of {drafted} proposed)")
        logger.info("%s", line)

    def _on_output(self, out: RequestOutput, step: list[int]) -> None:
        m = out.metrics
        if not isinstance(out.outputs, list):   # an embedding: its prompt, once, when done
            if out.finished:
                if out.outputs.finish_reason == "stop":     # (computed, not aborted)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    step[0] += len(out.prompt_token_ids)
                if m is not None and m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                self.success.labels(self.model_name, out.outputs.finish_reason or "abort").inc()
                if m is not None and m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        seen, last = self._seen.get(out.request_id, (0, None))
        new = tokens - seen
        if new > 0 and m is not None and m.last_token_time is not None:
            step[0] += len(out.prompt_token_ids) if seen == 0 else 0
            step[1] += new
            if seen == 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                new_after_first = new - 1
            else:
                new_after_first = new
            if last is not None and new_after_first > 0:
                gap = (m.last_token_time - last) / new_after_first
                for _ in range(new_after_first):
                    self.itl.observe(gap)
            self.generation_tokens.inc(new)
            self._seen[out.request_id] = (tokens, m.last_token_time)
        if out.finished:
            self._seen.pop(out.request_id, None)
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
            self.success.labels(self.model_name, reason or "abort").inc()
            if m is not None and m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)

    def on_tenant_usage(self, tenant: str, prompt: int, completion: int,
                        reason: Optional[str], adapter: Optional[str] = None) -> None:
        labels = (self.model_name, tenant, adapter or "")
        self.tenant_prompt.labels(*labels).inc(prompt)
        self.tenant_generation.labels(*labels).inc(completion)
        self.tenant_requests.labels(*labels, reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(_VllmNames(self.registry))


class _VllmNames:
    """A registry-like view of `registry`'s folio: families in VLLM_NAMES
    under their vllm: names (generate_latest reads any object that collects)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            name = family.name.removeprefix("folio:")
            if name not in VLLM_NAMES:
                continue
            alias = Metric(f"vllm:{name}", family.documentation, family.type, family.unit)
            for s in family.samples:
                alias.add_sample("vllm:" + s.name.removeprefix("folio:"), s.labels, s.value,
                                 s.timestamp, s.exemplar)
            yield alias
