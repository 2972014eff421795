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
    logprobs: Optional[int] = None          # top-k logprobs wanted per sampled token
    prompt_logprobs: Optional[int] = None   # top-k logprobs wanted per prompt token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    min_tokens: int = 0
    min_tokens_banned: tuple[int, ...] = ()    # EOS and stop ids, masked before min_tokens
    num_prompt_tokens: int = 0                 # where the sequence's output starts

    @property
    def needs_history(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.min_tokens > 0)


@dataclass
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]          # tokens computed this step, at positions start_pos ..
    start_pos: int                # = tokens already in the KV cache for this sequence
    new_block_ids: list[int]      # appended to the runner's copy of the block table
    block_ids: Optional[list[int]] = None      # full table when (re)started or changed
    sampling: Optional[SamplingInfo] = None    # set when (re)started
    sample: bool = True           # False for a prefill chunk that does not reach the end
    # Prompt tokens at positions start_pos + 1 .. (within the prompt): the row of
    # position p scores token p + 1. Set only when prompt logprobs were asked for.
    prompt_targets: Optional[list[Optional[int]]] = None   # None rows: scored already
    # n > 1 at the end of the prompt: also sample these sequences from this row;
    # each then starts with a copy of this sequence's block table.
    fork_children: Optional[list[tuple[int, "SamplingInfo"]]] = None
    # (Re)started after a prefix-cache hit, for samplers that need every token
    # seen (penalties, min_tokens): the tokens before start_pos.
    history_prefix: Optional[list[int]] = None


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


TopLogprobs = list[tuple[int, float]]      # (token id, logprob), best first


@dataclass
class ModelRunnerOutput:
    """One sampled token per sequence scheduled with sample=True, in order."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Per sampled sequence: its top logprobs when it asked for them, else None.
    top_logprobs: list[Optional[TopLogprobs]] = field(default_factory=list)
    # seq_id -> (logprob of the target, top logprobs) for each prompt target of the chunk.
    prompt_logprobs: dict[int, list[tuple[float, TopLogprobs]]] = field(default_factory=dict)
    # seq_id -> error, for sequences whose inputs could not be prepared or
    # sampled this step: their requests fail alone, the engine goes on.
    failed: dict[int, str] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step did to one sequence: tokens appended, maybe finished."""

    request_id: str
    index: int                        # which of the request's n sequences
    new_token_ids: list[int]
    new_logprobs: list[float]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    new_top_logprobs: Optional[list[TopLogprobs]] = None
    prompt_logprobs: Optional[list[tuple[float, TopLogprobs]]] = None
    beams: Optional[list] = None      # beam search, when it ends: core.beam.Hypothesis, best first
    error: Optional[str] = None       # the request failed in the step (finish_reason "error")
