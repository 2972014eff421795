"""SamplingParams: how one request is decoded, validated up front.

Field names and defaults mirror vLLM's so its users switch by changing an import.
Every check raises a ValueError naming the field, before any block is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from folio.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Seeds and top-k reach torch as int64: a larger value would fail inside the
# engine step instead of here.
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_p")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 or -1: no top-k
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16   # None: up to the end of the context
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None          # top logprobs per generated token (0: the chosen one)
    prompt_logprobs: Optional[int] = None   # the same for every prompt token but the first
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0           # - p if the token was generated already
    frequency_penalty: float = 0.0          # - f x times it was generated
    repetition_penalty: float = 1.0         # logits of prompt or generated tokens / r (x r if < 0)
    min_p: float = 0.0                      # drop tokens below min_p x the top probability
    logit_bias: Optional[dict[int, float]] = None   # token id -> added to its logit
    min_tokens: int = 0                     # no EOS or stop token before this many
    include_stop_str_in_output: bool = False
    # what the output must match (JSON schema, regex, choice, grammar); a dict
    # of StructuredOutputsParams' fields is taken too
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from e
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be StructuredOutputsParams or a dict of "
                             "its fields")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError("logit_bias must map token ids to numbers") from e
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in _FLOATS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not INT64_MIN <= self.seed <= INT64_MAX - self.n + 1):
            raise ValueError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX - self.n + 1}] "
                             f"(sample i of n uses seed + i), got {self.seed!r}")
        if self.temperature is None or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is None or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        # (NaN fails the comparison too)
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def needs_history(self) -> bool:
        """Whether sampling depends on the tokens seen so far (penalties)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def keeps_history(self) -> bool:
        """Whether the runner keeps the sequence's tokens: for penalties, for
        min_tokens, and for a grammar matcher to follow its outputs."""
        return (self.needs_history or self.min_tokens > 0
                or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
