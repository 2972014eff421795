"""Tool calling on /v1/chat/completions: the request's tools, the constraint
a forced call is generated under, and the calls read back from the output.

`tool_choice` a named function: the output is that function's arguments,
generated under the JSON schema of its parameters. `"required"`: the output
is a JSON array of one call or more (one only with `parallel_tool_calls:
false`), each `{"name": <one of the tools>, "arguments": <its parameters>}`,
generated under the schema that says so. Either way the arguments always
parse and match. `"none"`: the tools are shown to the template and the model
answers in text. `"auto"` (the default with tools; the server needs
`--enable-auto-tool-choice --tool-call-parser hermes`): the model answers as
it likes, and the calls it writes in its template's format are read back
(`HermesParser`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class _Named(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _Named


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def tool_choice_problem(tools: list[Tool], choice: Optional[ToolChoice]
                        ) -> Optional[tuple[str, str]]:
    """(what is wrong, the field) with the tools and tool_choice, or None."""
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        return "tools: two tools have the same name", "tools"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return (f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names) or 'none given'})", "tool_choice")
    if choice == "required" and not names:
        return "tool_choice 'required' needs tools", "tool_choice"
    return None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool
                      ) -> Optional[dict[str, Any]]:
    """The structured_outputs a forced call is generated under (None: not forced)."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return {"json": _parameters(tool)}
    if choice != "required":
        return None
    calls = {"type": "array", "minItems": 1,
             "items": {"anyOf": [
                 {"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "arguments": _parameters(t)},
                  "required": ["name", "arguments"]} for t in tools]}}
    if not parallel:
        calls["maxItems"] = 1
    return {"json": calls}


def tool_calls(text: str, choice: ToolChoice) -> list[dict[str, Any]]:
    """The calls of a forced answer that ended (its text matches the schema)."""
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, text)]
    return [_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in json.loads(text)]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


PARSERS = ("hermes",)


class HermesParser:
    """Calls written as Hermes-2-Pro and Qwen2.5 templates ask: each a JSON
    object {"name", "arguments"} between <tool_call> and </tool_call> (the
    last one may lack its closing tag when EOS cut it). Text before the first
    call is the message's content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        """(content, calls); no call found (or one that does not parse): (text, [])."""
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls, at = [], start
        while at >= 0:
            body_at = at + len(self.OPEN)
            end = text.find(self.CLOSE, body_at)
            body = text[body_at:end if end >= 0 else len(text)]
            try:
                value = json.loads(body)
                name, arguments = value["name"], value.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError(name)
            except (ValueError, KeyError, TypeError):
                return text, []          # not a call after all: the text as it is
            calls.append(_call(name, json.dumps(arguments, ensure_ascii=False)))
            at = text.find(self.OPEN, end + len(self.CLOSE)) if end >= 0 else -1
        content = text[:start].rstrip()
        return (content or None), calls

    def safe_prefix(self, text: str) -> int:
        """How much of a growing text may stream as content: all of it up to the
        first call, or up to a tail that could still begin one."""
        start = text.find(self.OPEN)
        if start < 0:
            start = len(text)
            for keep in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
                if self.OPEN.startswith(text[-keep:]):
                    start = len(text) - keep
                    break
        # whitespace before a call is not part of the content: hold it back too
        return len(text[:start].rstrip())


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as templates take it: an assistant's earlier calls carry
    their arguments as a JSON string (OpenAI's form); templates expect the
    object (as vLLM gives them), so a string that parses is replaced by it."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = dict(m, tool_calls=[_with_object_arguments(c) for c in calls])
        out.append(m)
    return out


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return dict(call, function=dict(fn, arguments=arguments))
