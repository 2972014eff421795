"""Forced tool calls through the official `openai` client against `folio
serve` on the default model with a tool-calling chat template (the Hermes
template vLLM ships, tests/fixtures/chat_templates/hermes_tool_use.jinja):
a named function or "required", the arguments generated under the tool's
schema so they always validate; streamed calls equal unstreamed ones; tool
history accepted; the 400s of a tool_choice that cannot be served."""

from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (a dependency)")

from tests.server.conftest import ServerProcess

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "hermes_tool_use.jinja"


class GetWeather(BaseModel):
    """The weather in a city now."""
    city: str = Field(max_length=20, description="the city")
    unit: Literal["celsius", "fahrenheit"] = Field(description="the unit of temperature")


class Book(BaseModel):
    """Book a table at a restaurant."""
    restaurant: str = Field(max_length=20, description="its name")
    people: int = Field(ge=1, le=12, description="how many")


TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather"),
         openai.pydantic_function_tool(Book, name="book_table")]


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks",
                         "256", "--served-model-name", "smol", "--chat-template", str(TEMPLATE),
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--uvicorn-log-level", "warning"])
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    c.url = srv.url
    yield c
    srv.stop()


def ask(text):
    return [{"role": "user", "content": text}]


def test_a_named_tool_call_parses_into_its_model(client):
    done = client.chat.completions.parse(
        model="smol", messages=ask("What is the weather in Paris?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=100)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert GetWeather.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_of_the_tools_with_valid_arguments(client, parallel):
    done = client.chat.completions.create(
        model="smol", messages=ask("Book a table for two at Luigi's."), tools=TOOLS,
        tool_choice="required", parallel_tool_calls=parallel, temperature=0.7, seed=3, n=3,
        max_tokens=150)
    models = {"get_weather": GetWeather, "book_table": Book}
    ended = [c for c in done.choices if c.finish_reason == "tool_calls"]
    # one call a choice always ends; parallel calls may run on to max_tokens, and
    # then come back as the text they are, finish_reason "length"
    assert len(ended) == 3 if not parallel else ended
    assert all(c.finish_reason == "length" and c.message.content and not c.message.tool_calls
               for c in done.choices if c not in ended)
    for choice in ended:
        calls = choice.message.tool_calls
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            models[call.function.name].model_validate_json(call.function.arguments)


def test_streamed_calls_join_into_the_unstreamed_ones(client):
    kwargs = dict(model="smol", messages=ask("Weather in Oslo, please."), tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=100)
    full = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    assert finishes == ["tool_calls"]
    assert [calls[i] for i in sorted(calls)] == [
        {"name": t.function.name, "arguments": t.function.arguments}
        for t in full.message.tool_calls]


def test_a_conversation_with_tool_history_is_served(client):
    history = ask("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "18 degrees, sunny"},
    ]
    done = client.chat.completions.create(model="smol", messages=history, tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=12)
    assert done.choices[0].message.content and not done.choices[0].message.tool_calls


@pytest.mark.parametrize("body, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice names 'fly', which is not among the tools (get_weather, book_table)"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "give no response_format or structured_outputs with it"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_tool_choice_that_cannot_be_served_is_a_400(client, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=ask("Hi"), max_tokens=4,
                                       extra_body=body)
    assert message in str(e.value)


def test_earlier_calls_reach_the_template_as_objects():
    """OpenAI sends a call's arguments as a JSON string; the template writes
    them with tojson, so they are handed over parsed (as vLLM does), not
    quoted twice."""
    from folio.model.loader import load_model_config
    from folio.server.tools import template_messages
    from folio.tokenizer import get_tokenizer
    tok = get_tokenizer(load_model_config(None))
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "name": "get_weather", "content": "cold"}]
    text = tok.apply_chat_template(template_messages(history), chat_template=TEMPLATE.read_text(),
                                   tools=[t for t in TOOLS])
    assert '{ "arguments": {"city": "Oslo"}, "name": "get_weather"}' in text
    assert '<tool_response>\n{"name": "get_weather", "content": "cold"}' in text
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # untouched


# "auto": the model's own <tool_call> text is parsed. A 135M model rarely
# writes one by itself, so these tests make it write one (or plain text) with a
# regex constraint, a test device: the parsing path is the one every answer
# under "auto" takes.
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
             '"unit": "celsius"}}\n</tool_call>')


def _regex(text):
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_the_model_writes(client, stream):
    kwargs = dict(model="smol", messages=ask("Weather in Oslo?"), tools=TOOLS, temperature=0,
                  max_tokens=60, extra_body={"structured_outputs": {
                      "regex": "Let me check\\.\\n" + _regex(CALL_TEXT)}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, \
            choice.finish_reason
        calls = [(t.function.name, t.function.arguments) for t in calls]
    else:
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                content += c.delta.content or ""
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    calls[d.index] = (d.function.name, d.function.arguments)
        calls = [calls[i] for i in sorted(calls)]
    assert finish == "tool_calls" and content == "Let me check."
    assert calls == [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]


def test_auto_answers_in_text_when_the_model_writes_no_call(client):
    choice = client.chat.completions.create(
        model="smol", messages=ask("Hello"), tools=TOOLS, tool_choice="auto", max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["It is sunny <tool"]}}).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "It is sunny <tool"
    assert not choice.message.tool_calls


def test_auto_needs_the_server_flags(server):
    from tests.server.conftest import http
    status, _, body = http("POST", server.url + "/v1/chat/completions", {
        "model": "tiny", "messages": ask("Hi"), "max_tokens": 2, "tools": TOOLS})
    assert status == 400 and "--enable-auto-tool-choice --tool-call-parser hermes" in \
        body["error"]["message"]


def test_tool_answers_match_the_published_models(client):
    from tests.server.conftest import http
    from folio.server.responses import ChatCompletionResponse, ChatCompletionStreamResponse
    body = {"model": "smol", "messages": ask("Weather?"), "tools": TOOLS, "max_tokens": 60,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, _, answer = http("POST", client.url + "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["tool_calls"]
    ChatCompletionResponse.model_validate(answer)
    raw = http("POST", client.url + "/v1/chat/completions", {**body, "stream": True})[2]
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: {")]
    import json
    assert any("tool_calls" in e for e in events)
    for e in events:
        ChatCompletionStreamResponse.model_validate(json.loads(e))


def test_the_hermes_parser():
    from folio.server.tools import HermesParser
    p = HermesParser()
    two = ('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {}}')          # the last cut by EOS
    content, calls = p.parse(two)
    assert content == "Sure." and [(c["function"]["name"], c["function"]["arguments"])
                                   for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert p.parse("no call here") == ("no call here", [])
    assert p.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>",
                                                             [])
    assert p.parse('<tool_call>{"name": "a"}</tool_call>')[0] is None
    # streaming: nothing that could begin a call, nor the whitespace before one
    assert p.safe_prefix("Hello <tool") == len("Hello")
    assert p.safe_prefix("Hello <tool_call>{") == len("Hello")
    assert p.safe_prefix("Hello there") == len("Hello there")
    assert p.safe_prefix("Hello\n") == len("Hello")
