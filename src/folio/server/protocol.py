"""OpenAI-shaped request and response models (vLLM's are the reference).

A request is checked whole when it is parsed, so a bad one is a 400 naming the
field before anything runs:
- floats must be finite (Python's JSON parser accepts NaN and Infinity), and
  integers that reach torch or C code (seeds, counts, top_k, priority) must fit
  in an int64; the value ranges themselves are SamplingParams' to check;
- nothing is accepted only to be ignored: a field naming a feature Folio does
  not have yet is refused by name, and so is a field the request's mode does
  not read (beam search ignores the sampling knobs, length_penalty needs beam
  search, stream_options needs stream).
Unknown extra fields are accepted, as clients send many, and listed in one
warning line.
"""

from __future__ import annotations

import dataclasses

import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator,
                      model_validator)

from folio.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from folio.server.not_yet import NOT_YET, NOT_YET_CHAT, NOT_YET_COMPLETION
from folio.server.response_format import ResponseFormat
from folio.server.tools import (NamedToolChoice, Tool, ToolChoice, forced_constraint,
                                template_tools, tool_choice_problem)
from folio.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("folio")

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
MAX_N = 16                      # sequences (or beams) one request may ask for


class InvalidRequest(ValueError):
    """A 400 that names the field at fault (the error body's `param`)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# Sampling fields a beam search does not read: its steps rank the raw
# log-probabilities of every beam, with no sampling, penalties or stop strings.
_BEAM_IGNORES = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias", "stop",
                 "stop_token_ids", "seed", "min_tokens", "include_stop_str_in_output",
                 "skip_special_tokens")
_BEAM_ONLY = ("length_penalty", "early_stopping")


def _refuse_not_yet(extra: dict, not_yet: dict[str, tuple]) -> None:
    for name, unused in not_yet.items():
        if name in extra and extra[name] not in unused:
            raise InvalidRequest(f"'{name}' is not supported by Folio yet", name)
    unknown = sorted(set(extra) - set(not_yet))
    if unknown:
        logger.warning("the request has fields Folio does not know, ignored: %s",
                       ", ".join(unknown))


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    _not_yet: ClassVar[dict[str, tuple]] = NOT_YET

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null is the field's default (OpenAI marks most fields nullable,
        and clients generated from its spec send `"n": null`)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields
                or cls.model_fields[k].default is None}

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        """Every string of the body is text: JSON's \\ud800 escapes give a lone
        surrogate, which no tokenizer takes; a 400 naming where it is."""
        bad = _lone_surrogate(data, "")
        if bad is not None:
            raise InvalidRequest(f"{bad or 'the body'} holds a lone UTF-16 surrogate (an "
                                 f"unpaired \\ud800-\\udfff escape), which is not text",
                                 bad or None)
        return data

    @model_validator(mode="after")
    def _check_whole(self):
        _refuse_not_yet(self.model_extra or {}, self._not_yet)
        self._check()
        return self

    def _check(self) -> None:
        """Checks across fields; subclasses extend it."""


def _lone_surrogate(value: Any, where: str) -> Optional[str]:
    """The path of the first string (or key) in `value` that is not valid
    Unicode text, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{where}.{k}" if where else str(k)
            found = _lone_surrogate(k, path) if isinstance(k, str) else None
            found = found if found is not None else _lone_surrogate(v, path)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


# the roles a chat message may have: OpenAI's, and Llama 3.1's "ipython"
# (a tool's answer, as its template names it)
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_messages(messages: list[Any]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role is {str(role)[:40]!r}: a message's role is "
                                 f"one of {', '.join(ROLES)}", f"messages[{i}].role")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # usage (so far) in every chunk too


class _Sampling(_Request):
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Annotated[int, Field(ge=-1, le=INT64_MAX)]] = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Int64]] = None
    seed: Optional[Int64] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    user: Optional[str] = None              # informational, as at OpenAI
    priority: Int64 = 0                     # lower runs first (--scheduling-policy priority)
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: Count = 0
    include_stop_str_in_output: bool = False
    # vLLM's: exactly one of json (a schema), regex, choice, grammar, json_object
    structured_outputs: Optional[dict[str, Any]] = None
    response_format: Optional[ResponseFormat] = None      # OpenAI's

    def _check(self) -> None:
        super()._check()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options needs stream: true", "stream_options")
        constrained = self.constraint()
        if constrained is not None:
            try:
                StructuredOutputsParams(**constrained)
            except (TypeError, ValueError) as e:
                raise InvalidRequest(str(e), "structured_outputs" if self.structured_outputs
                                     is not None else "response_format") from e
            if self.use_beam_search:
                raise InvalidRequest("structured outputs do not work with beam search",
                                     "use_beam_search")
        if self.use_beam_search:
            self._check_beam()
            return
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("'best_of' different from 'n' is not supported by Folio yet "
                                 "(except with use_beam_search)", "best_of")
        for name in _BEAM_ONLY:
            if getattr(self, name) != _default(self, name):
                raise InvalidRequest(f"'{name}' only applies with use_beam_search: true", name)

    def _check_beam(self) -> None:
        if (self.best_of or self.n) < self.n:
            raise InvalidRequest("best_of must be at least n", "best_of")
        if self.stream:
            raise InvalidRequest("use_beam_search works without stream", "use_beam_search")
        for name in _BEAM_IGNORES:
            value = getattr(self, name)
            if value != _default(self, name) and value not in (None, [], {}):
                raise InvalidRequest(f"'{name}' is not used by beam search: leave it out "
                                     "with use_beam_search", name)

    def constraint(self) -> Optional[dict[str, Any]]:
        """What the output must match: structured_outputs or response_format
        (one of the two)."""
        fmt = self.response_format.structured_outputs() if self.response_format else None
        if fmt is not None and self.structured_outputs is not None:
            raise InvalidRequest("give one of response_format and structured_outputs",
                                 "structured_outputs")
        return self.structured_outputs if fmt is None else fmt

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        """The request's SamplingParams: every field of the same name, by name
        (null meaning the default, as at OpenAI), and the three whose request
        form differs per endpoint given here. `defaults` (the model's
        generation_config.json, --generation-config) fill the fields the
        request does not set."""
        named = {name: getattr(self, name) for name in _SAMPLING_FIELDS
                 if name in type(self).model_fields}
        for name, value in (defaults or {}).items():
            if name in named and (name not in self.model_fields_set
                                  or getattr(self, name) is None):
                named[name] = value
        named["structured_outputs"] = self.constraint()
        return SamplingParams(**{k: v for k, v in named.items() if v is not None},
                              max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# SamplingParams' fields a request carries under the same name; these three the
# endpoints derive (max_tokens from the context left, logprobs from their own
# shapes of it)
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                         if f.name not in ("max_tokens", "logprobs", "prompt_logprobs"))


def _default(model: BaseModel, name: str) -> Any:
    return type(model).model_fields[name].default


PromptIds = list[StrictInt]     # any size: the engine names ids outside the vocabulary


class CompletionRequest(_Sampling):
    _not_yet: ClassVar[dict[str, tuple]] = NOT_YET_COMPLETION
    prompt: Union[str, list[str], PromptIds, list[PromptIds]]
    max_tokens: Optional[Count] = 16        # 0 with echo: score the prompt, generate nothing
    echo: bool = False
    logprobs: Optional[Count] = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value, handler):
        try:
            return handler(value)
        except ValidationError:     # one message, not one per member of the union
            raise InvalidRequest("prompt must be a string, a list of strings, a list of token "
                                 "ids or a list of token-id lists", "prompt") from None

    def _check(self) -> None:
        super()._check()
        if self.scores_prompt_only and self.min_tokens:
            raise InvalidRequest("min_tokens must be 0 when max_tokens is 0", "min_tokens")

    def _check_beam(self) -> None:
        super()._check_beam()
        if self.logprobs is not None or self.echo:
            raise InvalidRequest("use_beam_search works without logprobs and echo",
                                 "use_beam_search")

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0


class _Templated(_Request):
    """The fields that pick and drive the chat template."""
    chat_template: Optional[str] = None     # template text, or the name of one of the model's
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def _check(self) -> None:
        super()._check()
        if getattr(self, "messages", None) is not None:
            check_messages(self.messages)
        self.template_kwargs()

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Tokenizer.apply_chat_template. chat_template_kwargs may
        repeat a request field (vLLM lets it), but not contradict one the request set."""
        own = {"add_generation_prompt": self.add_generation_prompt,
               "continue_final_message": self.continue_final_message,
               "chat_template": self.chat_template}
        extra = dict(self.chat_template_kwargs or {})
        for name in ("messages", "template", "special_tokens", "tools"):
            if name in extra:
                raise InvalidRequest(f"chat_template_kwargs may not set '{name}'",
                                     "chat_template_kwargs")
        for name in own:
            if name in extra:
                own[name] = self._merged_kwarg(name, extra.pop(name))
        return {**extra, **own}

    def _merged_kwarg(self, name: str, given: Any) -> Any:
        kind = str if name == "chat_template" else bool
        if not isinstance(given, kind) and not (kind is str and given is None):
            raise InvalidRequest(f"chat_template_kwargs.{name} must be a {kind.__name__}, got "
                                 f"{given!r}", "chat_template_kwargs")
        if name in self.model_fields_set and given != getattr(self, name):
            raise InvalidRequest(f"chat_template_kwargs.{name}={given!r} contradicts the "
                                 f"request's {name}={getattr(self, name)!r}",
                                 "chat_template_kwargs")
        return given


class ChatCompletionRequest(_Sampling, _Templated):
    _not_yet: ClassVar[dict[str, tuple]] = NOT_YET_CHAT
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: bool = False
    top_logprobs: Optional[Count] = None
    echo: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True      # with --reasoning-parser: send reasoning_content

    @property
    def forced_tool(self) -> Optional[ToolChoice]:
        """The tool_choice that forces a call (a named function, "required")."""
        choice = self.tool_choice
        return choice if self.tools and (choice == "required" or
                                         isinstance(choice, NamedToolChoice)) else None

    def constraint(self) -> Optional[dict[str, Any]]:
        forced = self.forced_tool
        if forced is None:
            return super().constraint()
        if self.response_format is not None and self.response_format.type != "text" \
                or self.structured_outputs is not None:
            raise InvalidRequest("a forced tool call is generated under its own schema: "
                                 "give no response_format or structured_outputs with it",
                                 "tool_choice")
        return forced_constraint(self.tools, forced, self.parallel_tool_calls)

    @property
    def auto_tools(self) -> bool:
        """Tools the model may call or not: its calls are parsed from its text."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return template_tools(self.tools) if self.tools else None

    def _check(self) -> None:
        problem = tool_choice_problem(self.tools or [], self.tool_choice)
        if problem is not None:
            raise InvalidRequest(*problem)
        if self.use_beam_search:
            raise InvalidRequest("use_beam_search is not supported on /v1/chat/completions "
                                 "(it is on /v1/completions)", "use_beam_search")
        if self.echo:
            raise InvalidRequest("echo is not supported on /v1/chat/completions", "echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        super()._check()


class TokenizeRequest(_Templated):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[Tool]] = None      # with messages: rendered as chat renders them
    add_special_tokens: bool = True         # for a prompt; a chat's template decides

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return template_tools(self.tools) if self.tools else None

    def _check(self) -> None:
        super()._check()
        if self.messages is None:
            if self.tools is not None:
                raise InvalidRequest("tools go with messages", "tools")
            return
        if self.prompt is not None:
            raise InvalidRequest("give 'prompt' or 'messages', not both", "prompt")
        if "add_special_tokens" in self.model_fields_set:
            raise InvalidRequest("add_special_tokens applies to a prompt: with messages, the "
                                 "chat template decides", "add_special_tokens")


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[StrictInt]


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (OpenAI's fields; `input` a string, a list of them, a
    list of token ids or a list of such lists)."""
    model: Optional[str] = None
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    priority: int = 0

    def _check(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequest(f"dimensions must be at least 1, got {self.dimensions}",
                                 "dimensions")
        if self.input == [] or self.input == "":
            raise InvalidRequest("input must not be empty", "input")


class RerankRequest(_Request):
    """POST /v1/rerank (vLLM's, Jina's and Cohere's shape)."""
    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: int = 0                      # 0: every document
    return_documents: bool = True
    priority: int = 0

    def _check(self) -> None:
        if not self.documents:
            raise InvalidRequest("documents must not be empty", "documents")
        if self.top_n < 0:
            raise InvalidRequest(f"top_n must be at least 0, got {self.top_n}", "top_n")


class ScoreRequest(_Request):
    """POST /score (vLLM's): text_1 against each of text_2, or pair by pair."""
    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    priority: int = 0

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(first) == 1:
            first = first * len(second)
        return list(zip(first, second))

    def _check(self) -> None:
        n1 = 1 if isinstance(self.text_1, str) else len(self.text_1)
        n2 = 1 if isinstance(self.text_2, str) else len(self.text_2)
        if not n1 or not n2:
            raise InvalidRequest("text_1 and text_2 must not be empty",
                                 "text_1" if not n1 else "text_2")
        if n1 != 1 and n1 != n2:
            raise InvalidRequest(f"text_1 has {n1} texts and text_2 {n2}: give one text_1, "
                                 "or as many as text_2", "text_1")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's fields)."""
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's fields; the id is not needed)."""
    lora_name: str
    lora_int_id: Optional[int] = None

