"""Request state owned by the scheduler: one or more sequences over one prompt.

A request's live sequences advance in lockstep (all hold the same number of
tokens until they finish), so `num_computed_tokens` is kept once per request.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Optional

from folio.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6          # failed inside an engine step; the engine went on

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_LAST_LIVE = RequestStatus.PREEMPTED     # a status above it is finished

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# a token sampled by a step still running (--async-scheduling): the runner puts
# the token it sampled there before the next step reads it
PLACEHOLDER = -1

_seq_ids = itertools.count()


def next_seq_id() -> int:
    """Sequence ids are unique in the process (requests and beam forks alike)."""
    return next(_seq_ids)


class Sequence:
    """One continuation of a request's prompt (index i of its n samples)."""

    def __init__(self, seq_id: int, index: int, prompt_token_ids: list[int], seed: int):
        self.seq_id = seq_id
        self.index = index
        self.token_ids = list(prompt_token_ids)   # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.seed = seed                          # seeds this sequence's own generator
        self.status = RequestStatus.WAITING
        self.cumulative_logprob = 0.0
        self.stop_reason: Optional[int] = None
        # --async-scheduling: tokens at the end of token_ids sampled by a step
        # still running (PLACEHOLDER until it returns; at most two)
        self.placeholders = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.placeholders]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> Optional[str]:
        return FINISH_REASONS.get(self.status)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], eos_token_ids: tuple[int, ...] = (),
                 arrival_time: Optional[float] = None, priority: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_prompt_logprobs_done = 0   # prompt positions already scored
        self.first_scheduled_time: Optional[float] = None
        self.num_cached_tokens: Optional[int] = None   # prompt tokens found in the prefix cache
        # n > 1: the prompt is computed once, for the first sequence; the others
        # fork from it when its last prompt token is sampled.
        self.forked = len(seqs) == 1
        self.beam = None        # a core.beam.BeamState for beam-search requests
        # an embedding request's PoolingParams (resolved): its prompt pooled, no token
        self.pooling = None
        # speculative decoding: proposal runs wholly rejected in a row, and the
        # decodes to go without proposals before the next try (Scheduler._proposals)
        self.spec_misses = 0
        self.spec_wait = 0
        # a draft model proposes for it (decided when it is first scheduled)
        self.draft_eligible = True
        self.lora = None        # a LoRARequest: the adapter it runs with (None: the base)

    @property
    def runs_ahead(self) -> bool:
        """Whether a step may be scheduled before this request's last token is
        known (--async-scheduling): one sequence, no beams, no grammar and no
        min_tokens: forks, beams and those need the token on the host first.
        (Penalties run ahead: the runner counts a token it has not seen on the
        host from the device, worker/sampling_columns.py.)"""
        p = self.params
        return (len(self.seqs) == 1 and self.beam is None
                and p.structured_outputs is None and not p.min_tokens)

    # (These three are read for every running request every step: a request of
    # one sequence, the common case, answers without a comprehension.)
    @property
    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:
            return [seqs[0]] if seqs[0].status <= _LAST_LIVE else []
        return [s for s in seqs if s.status <= _LAST_LIVE]

    @property
    def kv_seqs(self) -> list[Sequence]:
        """The live sequences that hold (or are about to hold) KV blocks."""
        return self.live_seqs if self.forked else self.seqs[:1]

    @property
    def num_tokens(self) -> int:
        """Tokens each live sequence holds (they are in lockstep)."""
        seqs = self.seqs
        if len(seqs) > 1:
            for s in seqs:
                if s.status <= _LAST_LIVE:
                    return len(s.token_ids)
        return len(seqs[0].token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
