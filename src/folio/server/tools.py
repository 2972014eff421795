"""Tool calling on /v1/chat/completions: the request's tools, the constraint
a forced call is generated under, and the calls read back from the output.

`tool_choice` a named function: the output is that function's arguments,
generated under the JSON schema of its parameters. `"required"`: the output
is a JSON array of one call or more (one only with `parallel_tool_calls:
false`), each `{"name": <one of the tools>, "arguments": <its parameters>}`,
generated under the schema that says so. Either way the arguments always
parse and match; `CallScanner` finds each call's name and arguments in the
text as it grows, so a stream sends the arguments as they are generated and an
answer cut by max_tokens keeps the calls it completed. `"none"`: the tools
are shown to the template and the model answers in text. `"auto"` (the
default with tools; the server needs `--enable-auto-tool-choice
--tool-call-parser hermes`): the model answers as it likes, and the calls it
writes in its template's format are read back (`HermesParser`:
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
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


def forced_calls(text: str, choice: ToolChoice, finish_reason: Optional[str]
                 ) -> tuple[list[dict[str, Any]], Optional[str]]:
    """(the calls a forced answer completed, its finish_reason). An answer cut
    short (max_tokens) keeps the calls it completed, with finish_reason
    "length"; [] when it completed none. The arguments are the generated text
    itself, as a stream sends it."""
    scanner = CallScanner(_function(choice))
    scanner.end(text)
    calls = [_call(c.name, scanner.arguments(text, c)) for c in scanner.calls if c.done]
    return calls, forced_finish(scanner, finish_reason)


def forced_finish(scanner: "CallScanner", finish_reason: Optional[str]) -> Optional[str]:
    return "tool_calls" if scanner.complete and finish_reason == "stop" else finish_reason


def _function(choice: ToolChoice) -> Optional[str]:
    return choice.function.name if isinstance(choice, NamedToolChoice) else None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ForcedCallStream:
    """One streamed choice of a forced call, as OpenAI streams calls: a call's
    first delta names it (`index`, `id`, `type`, `function.name`, empty
    `arguments`), the next ones carry its arguments as they are generated."""

    def __init__(self, choice: ToolChoice):
        self.scanner = CallScanner(_function(choice))
        self._sent: list[list] = []     # per call begun: [its id, characters of arguments sent]

    @property
    def begun(self) -> bool:
        return bool(self._sent)

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The `delta.tool_calls` entries of what `text` (the answer so far) adds."""
        if finished:
            self.scanner.end(text)
        else:
            self.scanner.feed(text)
        out = []
        for i, call in enumerate(self.scanner.calls):
            if call.name is None:       # named first; the calls after it wait for it
                break
            if i == len(self._sent):
                self._sent.append([_call_id(), 0])
                out.append({"index": i, "id": self._sent[i][0], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            arguments = self.scanner.arguments(text, call)
            if len(arguments) > self._sent[i][1]:
                out.append({"index": i, "function": {"arguments": arguments[self._sent[i][1]:]}})
                self._sent[i][1] = len(arguments)
        return out


_BLANK = " \t\n\r"
_SCALAR_END = _BLANK + ",]}"


@dataclass
class ScannedCall:
    """One call found in a forced answer: `start`/`end` bound its arguments' text."""
    name: Optional[str] = None
    start: Optional[int] = None     # where its arguments' value begins, once it has
    end: Optional[int] = None       # just past it, once it has ended
    done: bool = False              # the call is whole


class CallScanner:
    """Where a forced answer's calls are in its text, read as the text grows
    (each `feed` reads only what is new; a shorter text than read is ignored).

    The text is JSON the grammar let through: for "required" an array of
    {"name": ..., "arguments": ...} objects (keys in any order), for a named
    function (`function` given) the arguments alone. The scanner follows
    strings (escapes included), nesting and blanks, and notes where each call's
    name and arguments are; it never parses the arguments, so what streams
    and what the finished answer says are the same characters.
    """

    def __init__(self, function: Optional[str] = None):
        self.calls: list[ScannedCall] = []
        self.at = 0                 # characters read
        self.complete = False       # the whole top-level value has been read
        self._level = 2             # the depth of a call's fields: [ { "name": ...
        if function is not None:    # the text is the arguments of that one call
            self.calls.append(ScannedCall(name=function))
            self._level = 0
        self._stack: list[list] = []            # open containers: [bracket, a key is next]
        self._string: Optional[int] = None      # where the string being read began
        self._string_is_key = False
        self._escaped = False
        self._scalar: Optional[int] = None      # where the number or literal being read began
        self._key: Optional[str] = None         # the last key read among a call's fields

    def feed(self, text: str) -> None:
        for i in range(self.at, len(text)):
            if self.complete:
                break
            self._read(text, i)
        self.at = max(self.at, len(text))

    def end(self, text: str) -> None:
        """The text is all there is: a number or literal at its end ends there."""
        self.feed(text)
        if self._scalar is not None and not self.complete:
            start, self._scalar = self._scalar, None
            self._ended(text, start, len(text))

    def arguments(self, text: str, call: ScannedCall) -> str:
        """The call's arguments as far as they have been read."""
        if call.start is None:
            return ""
        return text[call.start:call.end if call.end is not None else self.at]

    def _read(self, text: str, i: int) -> None:
        ch = text[i]
        if self._string is not None:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._string_ended(text, i + 1)
            return
        if self._scalar is not None:
            if ch not in _SCALAR_END:
                return
            start, self._scalar = self._scalar, None
            self._ended(text, start, i)
            if self.complete:
                return
        top = self._stack[-1] if self._stack else None
        if ch in _BLANK:
            return
        if ch == '"':
            self._string, self._string_is_key = i, bool(top and top[0] == "{" and top[1])
            if not self._string_is_key:
                self._began(i)
        elif ch in "[{":
            self._began(i)
            self._stack.append([ch, True])
            if ch == "{" and self._level == 2 and len(self._stack) == 2:
                self.calls.append(ScannedCall())
        elif ch in "]}":
            if top is None:
                return
            self._stack.pop()
            if ch == "}" and self._level == 2 and len(self._stack) == 1 and self.calls:
                self.calls[-1].done = self.calls[-1].name is not None and \
                    self.calls[-1].end is not None
            self._ended(text, None, i + 1)
        elif ch in ":,":
            if top is not None:
                top[1] = ch == ","
        else:
            self._scalar = i
            self._began(i)

    def _string_ended(self, text: str, end: int) -> None:
        start, self._string = self._string, None
        if not self._string_is_key:
            self._ended(text, start, end)
        elif len(self._stack) == self._level:
            self._key = _loads(text[start:end])

    def _began(self, i: int) -> None:
        if len(self._stack) == self._level and self.calls and \
                (self._level == 0 or self._key == "arguments"):
            self.calls[-1].start = i

    def _ended(self, text: str, start: Optional[int], end: int) -> None:
        """A value ended at `end` (`start`: where it began, for a string or scalar)."""
        depth = len(self._stack)
        if depth == self._level and self.calls:
            call = self.calls[-1]
            if self._level == 0 or self._key == "arguments":
                call.end = end
            elif self._key == "name" and start is not None and text[start] == '"':
                call.name = _loads(text[start:end])
        if depth == 0:
            self.complete = True
            if self._level == 0:
                self.calls[0].done = True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


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


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as templates read them: OpenAI's clients may leave out a
    function's description (pydantic_function_tool without a docstring) or its
    parameters, which templates use unchecked (Hermes: `" - " +
    tool.description`); they get "" and an empty object schema."""
    out = []
    for t in tools:
        tool = t.model_dump(exclude_none=True)
        tool["function"]["description"] = t.function.description or ""
        tool["function"]["parameters"] = _parameters(t)
        out.append(tool)
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as templates take it: an assistant's earlier calls carry
    their arguments as a JSON string (OpenAI's form); templates expect the
    object (as vLLM gives them), so a string that parses is replaced by it.
    A tool's answer names its call by `tool_call_id` alone (OpenAI's form);
    templates want the function's `name`, so it is taken from the earlier
    call of that id (one no call had is left as it is)."""
    out, names = [], {}
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = dict(m, tool_calls=[_with_object_arguments(c) for c in calls])
            names.update(_call_names(calls))
        answered = m.get("tool_call_id")
        if m.get("role") == "tool" and m.get("name") is None and isinstance(answered, str) \
                and answered in names:
            m = dict(m, name=names[answered])
        out.append(m)
    return out


def _call_names(calls: list[Any]) -> dict[str, str]:
    """id -> function name of an assistant message's calls."""
    names = {}
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(call.get("id"), str) and \
                isinstance(fn.get("name"), str):
            names[call["id"]] = fn["name"]
    return names


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return dict(call, function=dict(fn, arguments=arguments))


# A template that never writes `tools` (SmolLM2's, many small models'): the
# model would be asked to call tools it was never shown. Folio then writes
# them into a system message of its own, in a generic form (as llama.cpp's
# generic tool format does), with what the answer must look like.
_PROBE_TOOL = {"type": "function", "function": {"name": "folio_probe_tool",
                                                "description": "probe",
                                                "parameters": {"type": "object"}}}
_renders_tools: dict[str, bool] = {}
_RENDERS_TOOLS_KEPT = 64       # templates remembered (a request's own may be any text)


def template_renders_tools(tokenizer, chat_template: Optional[str]) -> bool:
    """Whether the template a request renders with writes its tools into the
    prompt (rendered once with a probe tool and once without; cached by the
    template's text)."""
    try:
        source = tokenizer._pick_template(chat_template, [_PROBE_TOOL])
    except ValueError:          # no template: the real render says so
        return True
    if source not in _renders_tools:
        probe = [{"role": "user", "content": "x"}]
        try:
            with_tool = tokenizer.apply_chat_template(probe, chat_template=chat_template,
                                                      tools=[_PROBE_TOOL])
            without = tokenizer.apply_chat_template(probe, chat_template=chat_template)
            if len(_renders_tools) >= _RENDERS_TOOLS_KEPT:
                _renders_tools.pop(next(iter(_renders_tools)))     # the oldest
            _renders_tools[source] = with_tool != without
        except Exception:       # noqa: BLE001 - the real render reports the template's fault
            return True
    return _renders_tools[source]


def tools_note(tools: list[Tool], choice: Optional[ToolChoice], parallel: bool) -> str:
    """The system message text that shows `tools` to a model whose template
    does not, and says what its answer must be (what the forced call's
    grammar, or the Hermes parser of tool_choice "auto", reads)."""
    lines = ["You can call these tools (each with the JSON schema of its arguments):"]
    lines += [json.dumps({"name": t.function.name, "description": t.function.description or "",
                          "parameters": _parameters(t)}, ensure_ascii=False) for t in tools]
    if isinstance(choice, NamedToolChoice):
        lines.append(f"Call {choice.function.name}: answer with only the JSON object of its "
                     f"arguments.")
    elif choice == "required":
        many = "one call or more" if parallel else "one call"
        lines.append(f'Answer with only a JSON array of {many}, each {{"name": <a tool\'s '
                     f'name>, "arguments": <its arguments>}}.')
    elif choice == "none":
        lines.append("Do not call them now: answer in text.")
    else:
        lines.append('To call one, answer with <tool_call>{"name": <its name>, "arguments": '
                     '<its arguments>}</tool_call>; otherwise answer in text.')
    return "\n".join(lines)


def with_tools_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """`note` added to the conversation's system message (a new first one if
    it has none, or one whose content is not plain text)."""
    if messages and messages[0].get("role") in ("system", "developer") and \
            isinstance(messages[0].get("content"), str):
        return [dict(messages[0], content=messages[0]["content"] + "\n\n" + note),
                *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
