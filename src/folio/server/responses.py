"""OpenAI-shaped response models: they document the API in /openapi.json.

The handlers build plain dicts of the same shape (cheaper than models on the
streaming path); tests/server/test_openapi.py validates real responses against
these models, and `extra="forbid"` makes a field missing here a test failure.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    # The last chunk's with include_usage; every chunk's with continuous_usage_stats.
    usage: Optional[Usage] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob]


class FunctionCall(_Response):
    name: str
    arguments: str                      # a JSON object, as text


class ToolCall(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Response):
    role: Literal["assistant"]
    content: Optional[str]              # null when the answer is tool calls alone
    tool_calls: Optional[list[ToolCall]] = None
    reasoning_content: Optional[str] = None     # with --reasoning-parser: the thinking


class FunctionCallDelta(_Response):
    name: Optional[str] = None          # in the call's first chunk
    arguments: Optional[str] = None     # the text generated since the call's last chunk


class ToolCallDelta(_Response):
    index: int
    id: Optional[str] = None            # in the call's first chunk, with its type and name
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCallDelta] = None


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Optional[Literal["assistant"]] = None
    reasoning_content: Optional[str] = None             # with --reasoning-parser
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None    # forced: as generated; auto: whole


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None           # as in CompletionStreamResponse


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: Optional[str] = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(_Response):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]      # encoding_format "base64": float32s, little-endian


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreData(_Response):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class ResponseOutputText(_Response):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ResponseMessageItem(_Response):
    id: str
    type: Literal["message"]
    status: str
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionCallItem(_Response):
    id: str
    type: Literal["function_call"]
    status: str
    call_id: str
    name: str
    arguments: str


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Response):
    """POST /v1/responses (OpenAI's Response; server/responses_api.py)."""
    id: str
    object: Literal["response"]
    created_at: float
    status: str
    model: str
    output: list[Union[ResponseMessageItem, ResponseFunctionCallItem]]
    output_text: Optional[str] = None
    error: None = None
    incomplete_details: None = None
    instructions: Optional[str] = None
    metadata: dict[str, Any]
    max_output_tokens: Optional[int] = None
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: None = None
    store: bool
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any]
    tool_choice: Union[str, dict[str, Any]]
    tools: list[dict[str, Any]]
    truncation: str
    usage: Optional[ResponseUsage] = None


class ResponseStreamEvent(_Response):
    """One event of a streamed response (its `type` says which; the fields
    of OpenAI's events of that type beside)."""
    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class VersionResponse(_Response):
    version: str


class UsageRow(_Response):
    tenant: Optional[str] = None
    day: Optional[str] = None
    model: Optional[str] = None
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    aborted: int
    cost: Optional[float]


class UsageReport(_Response):
    object: Literal["list"]
    by: Literal["tenant", "day", "model"]
    data: list[UsageRow]


class RenderedPrompt(_Response):
    """/v1/completions/render (a list, one per prompt) and
    /v1/chat/completions/render: the token ids the request would run on."""
    model: str
    token_ids: list[int]
    features: None = None       # multimodal features: Folio serves text only


class LoadResponse(_Response):
    load: int


class ModelInfoResponse(_Response):
    model_path: str
    tokenizer_path: str
    is_generation: bool
