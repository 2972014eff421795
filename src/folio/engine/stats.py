"""StepStats: what a front end may know about the scheduler after one step.

The engine builds it in its own thread and hands it to the metrics callback,
so a front end reads numbers, never the scheduler, and the engine core could
later live in another process behind the same message. Counters are totals
since start: a reader takes differences, and a step it missed loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.core.spec_decode import SpecDecodeCounts


@dataclass(frozen=True)
class StepStats:
    num_running: int            # requests in the running batch
    num_waiting: int            # requests waiting to be scheduled (the autoscaling signal)
    kv_cache_usage: float       # fraction (0-1) of KV blocks held by some sequence
    kv_cache_waste: float       # fraction (0-1) of the slots in held blocks holding no token
    num_preemptions: int        # total preemptions of running requests
    prefix_cache_queries: int   # total prompt tokens looked up in the prefix cache
    prefix_cache_hits: int      # of which found
    # speculative decoding: proposal runs, tokens proposed, of which accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # engine steps run, and the seconds the engine was busy with them: from
    # a busy spell's first step to the end of its last, the driving loop's
    # work between steps included (steps / busy seconds: the step rate)
    num_steps: int = 0
    busy_seconds: float = 0.0

    @property
    def spec(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.spec_num_drafts, self.spec_num_draft_tokens,
                                self.spec_num_accepted_tokens)
