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
    finish_reason: Optional[str] = None    # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[int | str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
