"""User-facing results, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    # "stop" | "length" | "abort" | "error" (failed in the engine) | None while running
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    # With SamplingParams.logprobs: per token, {token id: logprob} holding the
    # chosen token and the top-k ones (raw model distribution).
    logprobs: Optional[list[dict[int, float]]] = None
    # Beam search: the length-normalised score the beams are ranked by.
    score: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """time.monotonic() stamps of one request's life (for latency metrics)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs: None for the first token, then
    # {token id: logprob} with the prompt token and the top-k ones.
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: Optional[RequestMetrics] = None
    num_preemptions: int = 0
    num_cached_tokens: Optional[int] = None     # prompt tokens served from the prefix cache
    error: Optional[str] = None     # why the engine failed this request (finish_reason "error")


@dataclass
class EmbeddingOutput:
    """An embedding request's vector (vLLM's EmbeddingOutput)."""

    embedding: list[float]
    finish_reason: Optional[str] = None      # "stop" once computed ("error", "abort")

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's EmbeddingRequestOutput):
    `outputs.embedding` the vector; `error` set (and `outputs.embedding`
    empty) where the engine failed the request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: Optional[int] = None
    error: Optional[str] = None


@dataclass
class ScoringOutput:
    """A pair's score (vLLM's ScoringOutput): a cross-encoder's one logit
    through the sigmoid."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair (vLLM's ScoringRequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
    error: Optional[str] = None
