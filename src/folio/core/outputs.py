"""Typed messages between the scheduler and the model runner.

Small dataclasses that pickle cheaply (they will cross process boundaries for
tensor parallelism): each step sends what changed, not whole requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SamplingInfo:
    """What the runner needs to sample for a sequence; sent when it (re)starts."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclass
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]          # tokens computed this step, at positions start_pos ..
    start_pos: int                # = tokens already in the KV cache for this sequence
    new_block_ids: list[int]      # appended to the runner's copy of the block table
    block_ids: Optional[list[int]] = None      # full table when (re)started or changed
    sampling: Optional[SamplingInfo] = None    # set when (re)started
    sample: bool = True           # False for a prefill chunk that does not reach the end


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)   # runner drops their state
    # (src, dst) physical blocks copied before the forward (copy-on-write).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class ModelRunnerOutput:
    """One sampled token per sequence scheduled with sample=True, in order."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one step did to one sequence: tokens appended, maybe finished."""

    request_id: str
    index: int                        # which of the request's n sequences
    new_token_ids: list[int]
    new_logprobs: list[float]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
