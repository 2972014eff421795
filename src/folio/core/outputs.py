"""Typed messages between the scheduler and the model runner.

Small dataclasses that pickle cheaply (they will cross process boundaries for
tensor parallelism): each step sends what changed, not whole requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from folio.lora_request import LoRARequest
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class SamplingInfo:
    """What the runner needs to sample for a sequence; sent when it (re)starts:
    the request's SamplingParams as they are (one source of truth for the
    sampling fields: a new one needs no copy here), and what is this sequence's
    own. In one process the runner reads the request's own params object, so
    params must not change once the request is added (tensor-parallel workers
    read a pickled copy)."""

    params: SamplingParams
    seed: int = 0                              # this sequence's generator seed
    num_prompt_tokens: int = 0                 # where the sequence's output starts
    min_tokens_banned: tuple[int, ...] = ()    # EOS and stop ids, masked before min_tokens
    lora: Optional[LoRARequest] = None         # the adapter it runs with
    # an embedding request (its fields resolved): its prompt's hidden states
    # pooled into ModelRunnerOutput.pooled at its last chunk, nothing sampled
    pooling: Optional[PoolingParams] = None

    @property
    def temperature(self) -> float:
        """0 for greedy rows (a temperature below the greedy threshold included)."""
        return 0.0 if self.params.greedy else self.params.temperature

    @property
    def needs_history(self) -> bool:
        p = self.params
        return (p.presence_penalty != 0 or p.frequency_penalty != 0
                or p.repetition_penalty != 1 or p.min_tokens > 0)


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
    # Speculative decoding: proposed tokens after the decode token, at positions
    # start_pos + 1 ..; token_ids = [the decode token] + these. The runner
    # verifies them (core/spec_decode.py).
    spec_token_ids: Optional[list[int]] = None


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)   # runner drops their state
    # (src, dst) physical blocks copied before the forward (copy-on-write).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    # --async-scheduling: the runner keeps what it samples for the next step's
    # PLACEHOLDER tokens
    ahead: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


TopLogprobs = list[tuple[int, float]]      # (token id, logprob), best first


@dataclass
class ModelRunnerOutput:
    """One sampled token per sequence scheduled with sample=True, in order; a
    sequence that carried proposed tokens has one entry per token it keeps,
    consecutive: the proposals accepted, then the target's own next token."""

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
    # seq_id -> the embedding of a pooling sequence whose prompt ended this step
    pooled: dict[int, list[float]] = field(default_factory=dict)
    # samples still where they were drawn (worker/ahead.py SampledRows), made
    # into the lists above by `materialize` (under --async-scheduling: once the
    # engine takes the step)
    pending: list = field(default_factory=list)

    def materialize(self) -> "ModelRunnerOutput":
        for part in self.pending:
            seq_ids, tokens, logprobs, tops = part.lists()
            self.seq_ids.extend(seq_ids)
            self.token_ids.extend(tokens)
            self.logprobs.extend(logprobs)
            self.top_logprobs.extend(tops)
        self.pending = []
        return self


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
    pooled: Optional[list[float]] = None   # an embedding request's vector, when it ends

    def __reduce__(self):
        """Pickled as its fields in order (a core process sends hundreds a
        step): half the time of a dataclass's pickled state, a third to load."""
        return (EngineCoreOutput, (self.request_id, self.index, self.new_token_ids,
                                   self.new_logprobs, self.finish_reason, self.stop_reason,
                                   self.new_top_logprobs, self.prompt_logprobs, self.beams,
                                   self.error, self.pooled))


def describe_fault(e: BaseException) -> str:
    """A sequence's fault as ModelRunnerOutput.failed and its request's error say it."""
    return f"{type(e).__name__}: {e}"

