"""POST /v1/responses: OpenAI's Responses API, through the chat path.

A request is turned into the chat completion it means, run by
`create_chat_completion` (templates, tools, structured output, limits,
tenants and usage as there), and its answer into a Response:

- `input`: a string (one user message) or items: messages (`role` user,
  system, developer or assistant; `content` a string or `input_text` /
  `output_text` parts), `function_call` items (the assistant's earlier
  calls) and `function_call_output` items (their results, as tool
  messages); `instructions` a system message before them;
- `tools` (`{"type": "function", "name", "description", "parameters"}`) and
  `tool_choice` ("auto", "none", "required" or `{"type": "function",
  "name"}`) as the chat's; `text.format` (`json_schema`, `json_object`,
  `text`) as its `response_format`; `max_output_tokens`, `temperature`,
  `top_p`;
- the output: a `message` item of `output_text`, or `function_call` items
  (`call_id`, `name`, `arguments`); `usage` in input and output tokens;
- `stream: true`: the events `response.created`, `response.in_progress`,
  `response.output_item.added`, `response.content_part.added`,
  `response.output_text.delta` (as the chat's text streams),
  `response.output_text.done`, `response.content_part.done`,
  `response.output_item.done` (function calls: added and done whole, with
  `response.function_call_arguments.done`), `response.completed`.

Folio keeps no responses: `previous_response_id`, `store: true` stays a
no-op, and background mode are refused by name (send the conversation as
input items instead).
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from folio.server.chat import create_chat_completion
from folio.server.protocol import ChatCompletionRequest, InvalidRequest, _Request, random_id
from folio.server.serving import TicketedStream, sse


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    background: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    user: Optional[str] = None
    truncation: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None

    def _check(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequest("previous_response_id is not supported: Folio keeps no "
                                 "responses; send the conversation as input items",
                                 "previous_response_id")
        if self.background:
            raise InvalidRequest("background responses are not supported", "background")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequest("truncation 'auto' is not supported: an input longer than "
                                 "the context is a 400", "truncation")
        if self.input == "" or self.input == []:
            raise InvalidRequest("input must not be empty", "input")

    def chat(self) -> ChatCompletionRequest:
        """The chat completion this request means (ValueError naming the field)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += _messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("user", "user")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if isinstance(choice, dict):
                if choice.get("type") != "function" or "name" not in choice:
                    raise InvalidRequest("tool_choice must be auto, none, required or "
                                         '{"type": "function", "name": ...}', "tool_choice")
                choice = {"type": "function", "function": {"name": choice["name"]}}
            body["tool_choice"] = choice
        fmt = (self.text or {}).get("format")
        if fmt is not None and fmt.get("type") != "text":
            if fmt.get("type") == "json_schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
            elif fmt.get("type") == "json_object":
                body["response_format"] = {"type": "json_object"}
            else:
                raise InvalidRequest(f"text.format type {fmt.get('type')!r} is not supported; "
                                     "supported: text, json_schema, json_object", "text.format")
        try:
            return ChatCompletionRequest(**body)
        except ValidationError as e:            # a field of ours, as the chat checks it
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise InvalidRequest(f"{where}: {first.get('msg')}" if where else
                                 str(first.get("msg")), where or None) from None


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or "name" not in tool:
        raise InvalidRequest(f"tools[{i}]: only function tools ({{\"type\": \"function\", "
                             f"\"name\": ...}}) are supported", f"tools[{i}]")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text",
                                                                      "output_text", "text"):
                raise InvalidRequest(f"{where}.content[{j}]: only text parts (input_text, "
                                     "output_text) are supported", f"{where}.content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequest(f"{where}.content must be a string or a list of text parts",
                         f"{where}.content")


def _messages(items: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Input items -> chat messages (an assistant's function calls joined to
    its message, their outputs as tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}.role must be user, system, developer or "
                                     "assistant", f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": str(item.get("output", ""))})
        else:
            raise InvalidRequest(f"{where}: input items of type {kind!r} are not supported; "
                                 "supported: message, function_call, function_call_output",
                                 where)
    return out


def _response(req: ResponsesRequest, rid: str, created: float, model: str, status: str,
              output: list, usage: Optional[dict] = None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "model": model, "output": output, "output_text": None, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "truncation": "disabled", "usage": usage}


def _usage(chat_usage: Optional[dict]) -> Optional[dict]:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"fc_{call['id']}", "type": "function_call", "status": "completed",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"]}


async def create_response(served, req: ResponsesRequest, raw: Request):
    chat = req.chat()
    rid, created = random_id("resp"), time.time()
    result = await create_chat_completion(served, chat, raw)
    model = served.model_name(req.model)
    if not req.stream:
        body = json.loads(result.body)
        message = body["choices"][0]["message"]
        output = [_call_item(c) for c in message.get("tool_calls") or []]
        if message.get("content") or not output:
            output.insert(0, _message_item(f"msg_{rid[5:]}", message.get("content") or ""))
        out = _response(req, rid, created, model, "completed", output, _usage(body["usage"]))
        out["output_text"] = "".join(p["text"] for item in output if item["type"] == "message"
                                     for p in item["content"])
        return JSONResponse(out)
    return TicketedStream(_events(req, result.body_iterator, rid, created, model),
                          result._ticket)


async def _payloads(chunks: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON of each `data:` event of the chat's stream ([DONE] left out)."""
    async for chunk in chunks:
        for block in chunk.split("\n\n"):
            if block.startswith("data: ") and not block.startswith("data: [DONE]"):
                yield json.loads(block[len("data: "):])


async def _events(req: ResponsesRequest, chunks: AsyncIterator[str], rid: str, created: float,
                  model: str) -> AsyncIterator[str]:
    """The chat's SSE chunks as Response events."""
    seq = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields})

    msg_id = f"msg_{rid[5:]}"
    text, calls, usage, opened = "", {}, None, False
    yield event("response.created", response=_response(req, rid, created, model,
                                                       "in_progress", []))
    yield event("response.in_progress", response=_response(req, rid, created, model,
                                                           "in_progress", []))
    try:
        async for payload in _payloads(chunks):
            if "error" in payload:
                yield event("error", code=str(payload["error"].get("code")),
                            message=payload["error"].get("message"), param=None)
                return
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices") or []:
                delta = choice.get("delta") or {}
                for call in delta.get("tool_calls") or []:
                    held = calls.setdefault(call.get("index", 0), {
                        "id": call.get("id"), "function": {"name": None, "arguments": ""}})
                    fn = call.get("function") or {}
                    held["id"] = held["id"] or call.get("id")
                    held["function"]["name"] = held["function"]["name"] or fn.get("name")
                    held["function"]["arguments"] += fn.get("arguments") or ""
                piece = delta.get("content")
                if piece:
                    if not opened:
                        opened = True
                        yield event("response.output_item.added", output_index=0,
                                    item=_message_item(msg_id, "", "in_progress") | {
                                        "content": []})
                        yield event("response.content_part.added", item_id=msg_id,
                                    output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "",
                                          "annotations": []})
                    text += piece
                    yield event("response.output_text.delta", item_id=msg_id, output_index=0,
                                content_index=0, delta=piece, logprobs=[])
    finally:
        await chunks.aclose()
    output = []
    if opened:
        part = {"type": "output_text", "text": text, "annotations": []}
        yield event("response.output_text.done", item_id=msg_id, output_index=0,
                    content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=0,
                    content_index=0, part=part)
        output.append(_message_item(msg_id, text))
        yield event("response.output_item.done", output_index=0, item=output[-1])
    for i in sorted(calls):
        item = _call_item(calls[i])
        index = len(output)
        yield event("response.output_item.added", output_index=index,
                    item=item | {"status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, arguments=item["arguments"], name=item["name"])
        output.append(item)
        yield event("response.output_item.done", output_index=index, item=item)
    done = _response(req, rid, created, model, "completed", output, _usage(usage))
    done["output_text"] = text
    yield event("response.completed", response=done)
