"""OpenAI-shaped request models (vLLM's are the reference) and error bodies.

Unknown extra fields are accepted, as clients send many; but a field naming a
feature Folio does not have yet is refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from folio.sampling_params import SamplingParams

# field -> the value that means "not used"
_NOT_YET = {
    "response_format": None, "tools": None, "tool_choice": None, "functions": None,
    "function_call": None, "suffix": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    n: int = 1
    best_of: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    user: Optional[str] = None
    priority: int = 0
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    def refuse_missing_features(self) -> None:
        extra = self.model_extra or {}
        for name, unused in _NOT_YET.items():
            if extra.get(name, unused) not in (unused, None):
                raise ValueError(f"'{name}' is not supported by Folio yet")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise ValueError("'best_of' different from 'n' is not supported by Folio yet "
                             "(except with use_beam_search)")
        if not 1 <= self.n <= 16:
            raise ValueError(f"n must be between 1 and 16, got {self.n}")

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        self.refuse_missing_features()
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k, seed=self.seed,
            max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int]


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error",
             404: "not_found_error", 503: "service_unavailable"}
    return {"error": {"message": message, "type": kinds.get(status, "internal_server_error"),
                      "param": param, "code": status}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
