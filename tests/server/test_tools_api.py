"""Forced tool calls through the official `openai` client against `folio
serve` on the default model with a tool-calling chat template (the Hermes
template vLLM ships, tests/fixtures/chat_templates/hermes_tool_use.jinja):
a named function or "required", the arguments generated under the tool's
schema so they always validate; streamed arguments come as they are
generated and join into the unstreamed ones; an answer cut by max_tokens
keeps the calls it completed; tool history accepted in OpenAI's form; the
400s of a tool_choice that cannot be served; the README's server examples,
run as written."""

import json
import re
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (a dependency)")

from tests.server.conftest import ServerProcess, http

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "hermes_tool_use.jinja"
README = Path(__file__).parents[2] / "docs" / "serving.md"    # the README's server page
MODEL = "SmolLM2-135M-Instruct"     # the default model's served name, as the README calls it


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
                         "256", "--chat-template", str(TEMPLATE),
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         # the README's examples without max_tokens (its curl chat) end soon
                         "--max-tokens-default", "64", "--uvicorn-log-level", "warning"])
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    c.url = srv.url
    yield c
    srv.stop()


def ask(text):
    return [{"role": "user", "content": text}]


def test_a_named_tool_call_parses_into_its_model(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS,
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
        model=MODEL, messages=ask("Book a table for two at Luigi's."), tools=TOOLS,
        tool_choice="required", parallel_tool_calls=parallel, temperature=0.7, seed=3, n=3,
        max_tokens=150)
    models = {"get_weather": GetWeather, "book_table": Book}
    ended = [c for c in done.choices if c.finish_reason == "tool_calls"]
    # one call a choice always ends; parallel calls may run on to max_tokens, and
    # then come back as the calls completed before the cut, finish_reason "length"
    assert len(ended) == 3 if not parallel else ended
    assert all(c.finish_reason == "length" for c in done.choices if c not in ended)
    for choice in done.choices:
        calls = choice.message.tool_calls
        assert choice.message.content is None and len(calls) >= 1
        assert parallel or len(calls) == 1
        for call in calls:
            models[call.function.name].model_validate_json(call.function.arguments)


def stream_calls(client, **kwargs):
    """(the calls joined from a stream's deltas, its finish_reasons, the deltas),
    checking each delta has OpenAI's shape: a call's first names it, with its
    id and empty arguments; the next ones carry arguments alone."""
    calls, finishes, deltas = {}, [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            assert c.delta.content is None
            for d in c.delta.tool_calls or []:
                deltas.append(d)
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function"
                    assert d.function.name and d.function.arguments == ""
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.type is None and d.function.name is None and d.function.arguments
                    calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finishes, deltas


FORCED = {"named": {"type": "function", "function": {"name": "get_weather"}},
          "required, one call": "required", "required, parallel": "required"}


@pytest.mark.parametrize("choice", FORCED)
def test_streamed_arguments_come_as_generated_and_join_into_the_unstreamed_ones(client, choice):
    kwargs = dict(model=MODEL, messages=ask("Weather in Oslo, and a table for two at Luigi's."),
                  tools=TOOLS, tool_choice=FORCED[choice], temperature=0, max_tokens=120,
                  parallel_tool_calls=choice.endswith("parallel"))
    full = client.chat.completions.create(**kwargs).choices[0]
    expected = [(t.function.name, t.function.arguments) for t in full.message.tool_calls]
    calls, finishes, deltas = stream_calls(client, **kwargs)
    assert finishes == [full.finish_reason] and expected
    assert [(c["name"], c["arguments"]) for c in calls[:len(expected)]] == expected
    # a call cut by max_tokens has streamed what it had; the unstreamed answer drops it
    assert len(calls) == len(expected) + (full.finish_reason == "length" and
                                          len(calls) > len(expected))
    assert len(deltas) > 3 * len(calls)         # the arguments came in pieces, not whole


def test_a_streamed_forced_call_carries_its_logprobs(client):
    """logprobs on a forced call's stream: every generated token once, in order,
    as the unstreamed answer has them (greedy: the same tokens)."""
    kwargs = dict(model=MODEL, messages=ask("Weather in Oslo?"), tools=TOOLS,
                  tool_choice=FORCED["named"], temperature=0, max_tokens=60, logprobs=True,
                  top_logprobs=2)
    full = client.chat.completions.create(**kwargs)
    expected = [(t.token, t.logprob) for t in full.choices[0].logprobs.content]
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for t in (c.logprobs.content if c.logprobs else None) or []:
                assert len(t.top_logprobs) == 2
                streamed.append((t.token, t.logprob))
    assert len(expected) == full.usage.completion_tokens
    # a token the grammar forbade is at the floor, not -inf (which JSON cannot hold)
    assert any(t.logprob == -9999.0 for e in full.choices[0].logprobs.content
               for t in e.top_logprobs)
    assert [t for t, _ in streamed] == [t for t, _ in expected]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(streamed, expected))


def test_the_openai_stream_helper_rebuilds_the_calls(client):
    with client.chat.completions.stream(
            model=MODEL, messages=ask("Book a table for two at Luigi's."), tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, temperature=0,
            max_tokens=120) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, (GetWeather, Book))
    assert events.count("tool_calls.function.arguments.delta") > 3
    assert events.count("tool_calls.function.arguments.done") == 1


def test_required_cut_by_max_tokens_returns_the_calls_it_completed(client):
    from folio.server.tools import forced_calls
    kwargs = dict(model=MODEL, messages=ask("Weather in Oslo, then book a table at Luigi's."),
                  tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(max_tokens=300, logprobs=True, **kwargs).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    first = whole.message.tool_calls[0]
    # the number of tokens after which the first call is whole
    upto = next(n for n in range(1, len(tokens) + 1)
                if forced_calls("".join(tokens[:n]), "required", "length")[0])
    cut = client.chat.completions.create(max_tokens=upto, **kwargs).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    assert [(c.function.name, c.function.arguments) for c in cut.message.tool_calls] == \
        [(first.function.name, first.function.arguments)]
    calls, finishes, _ = stream_calls(client, max_tokens=upto, **kwargs)
    assert finishes == ["length"]
    assert (calls[0]["name"], calls[0]["arguments"]) == (first.function.name,
                                                         first.function.arguments)
    # cut before any call was whole: the text as it is
    early = client.chat.completions.create(max_tokens=upto - 1, **kwargs).choices[0]
    assert early.finish_reason == "length" and not early.message.tool_calls
    assert early.message.content == "".join(tokens[:upto - 1])


def test_a_tool_without_description_or_parameters_is_served(client):
    class Ping(BaseModel):
        host: str = Field(max_length=10)        # no docstring: no description sent
    tools = [openai.pydantic_function_tool(Ping, name="ping"),
             {"type": "function", "function": {"name": "now"}}]
    assert "description" not in tools[0]["function"]
    done = client.chat.completions.create(model=MODEL, messages=ask("Ping example.org"),
                                          tools=tools, tool_choice="required", temperature=0,
                                          parallel_tool_calls=False, max_tokens=40)
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name in ("ping", "now")


def tool_history(answer):
    return ask("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "content": "18 degrees, sunny", **answer},
    ]


# OpenAI's own form names the call by tool_call_id alone; the Hermes template
# wants the function's name, taken from the call of that id
@pytest.mark.parametrize("answer", [{"tool_call_id": "call_1", "name": "get_weather"},
                                    {"tool_call_id": "call_1"}])
def test_a_conversation_with_tool_history_is_served(client, answer):
    done = client.chat.completions.create(model=MODEL, messages=tool_history(answer),
                                          tools=TOOLS, tool_choice="none", temperature=0,
                                          max_tokens=12)
    assert done.choices[0].message.content and not done.choices[0].message.tool_calls


def test_tokenize_renders_tools_and_history_as_chat_does(client):
    """POST /tokenize with messages and tools: the prompt chat runs, token for token
    (its count is chat's usage.prompt_tokens; without the tools it is shorter)."""
    messages = tool_history({"tool_call_id": "call_1"})
    done = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    status, _, tokens = http("POST", client.url + "/tokenize", body)
    assert status == 200, tokens
    assert tokens["count"] == done.usage.prompt_tokens
    _, _, bare = http("POST", client.url + "/tokenize", {"model": MODEL, "messages": ask("x")})
    _, _, with_tools = http("POST", client.url + "/tokenize",
                            {"model": MODEL, "messages": ask("x"), "tools": TOOLS})
    assert with_tools["count"] > bare["count"]
    status, _, err = http("POST", client.url + "/tokenize",
                          {"model": MODEL, "prompt": "x", "tools": TOOLS})
    assert status == 400 and err["error"]["param"] == "tools"


def test_an_answer_to_no_earlier_call_is_left_to_the_template(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=tool_history({"tool_call_id": "x"}),
                                       tools=TOOLS, tool_choice="none", max_tokens=4)
    assert "Tool response dicts require a 'name' key" in str(e.value)


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
        client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4,
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
               {"role": "tool", "name": "get_weather", "content": "cold"},
               {"role": "tool", "tool_call_id": "c", "content": "windy"}]     # OpenAI's form
    text = tok.apply_chat_template(template_messages(history), chat_template=TEMPLATE.read_text(),
                                   tools=[t for t in TOOLS])
    assert '{ "arguments": {"city": "Oslo"}, "name": "get_weather"}' in text
    assert '<tool_response>\n{"name": "get_weather", "content": "cold"}' in text
    assert '<tool_response>\n{"name": "get_weather", "content": "windy"}' in text
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # untouched
    assert "name" not in history[3]


def test_tools_reach_the_template_with_what_it_reads():
    """pydantic_function_tool sends no description without a docstring; the
    Hermes template writes `" - " + tool.description`."""
    from folio.model.loader import load_model_config
    from folio.server.tools import Tool, template_tools
    from folio.tokenizer import get_tokenizer
    tok = get_tokenizer(load_model_config(None))

    class Ping(BaseModel):
        host: str
    given = [openai.pydantic_function_tool(Ping, name="ping"),
             {"type": "function", "function": {"name": "now"}}]
    tools = template_tools([Tool.model_validate(t) for t in given])
    assert tools[0]["function"]["description"] == "" and tools[0]["function"]["strict"] is True
    assert tools[1]["function"] == {"name": "now", "description": "",
                                    "parameters": {"type": "object", "properties": {}}}
    text = tok.apply_chat_template(ask("Hi"), chat_template=TEMPLATE.read_text(), tools=tools)
    assert '"name": "ping", "description": "ping(host: str) - ' in text
    assert '{"name": "now", "description": "now() - \n\n", "parameters": {}}' in text


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
    kwargs = dict(model=MODEL, messages=ask("Weather in Oslo?"), tools=TOOLS, temperature=0,
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
        model=MODEL, messages=ask("Hello"), tools=TOOLS, tool_choice="auto", max_tokens=20,
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
    body = {"model": MODEL, "messages": ask("Weather?"), "tools": TOOLS, "max_tokens": 60,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, _, answer = http("POST", client.url + "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["tool_calls"]
    ChatCompletionResponse.model_validate(answer)
    raw = http("POST", client.url + "/v1/chat/completions", {**body, "stream": True})[2]
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: {")]
    assert any("tool_calls" in e for e in events)
    for e in events:
        ChatCompletionStreamResponse.model_validate(json.loads(e))


def _server_examples() -> str:
    """The server page's opening, before its first section."""
    text = README.read_text()
    return text[:text.find("\n## ")]


def readme_python() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", _server_examples(), re.S | re.M)


def test_the_readme_server_examples_run_as_written(client, monkeypatch, capsys):
    """The README's python of its server section, verbatim, against a server
    of the default model with the Hermes template (as the README says to
    serve it); only the client's address is this test's server's."""
    blocks = readme_python()
    assert blocks and "pydantic_function_tool(GetWeather" in blocks[-1]

    class ToThisServer(openai.OpenAI):
        def __init__(self, *, base_url, **kwargs):
            assert base_url == "http://127.0.0.1:8000/v1"     # `make run`'s
            super().__init__(base_url=client.url + "/v1", **kwargs)
    monkeypatch.setattr(openai, "OpenAI", ToThisServer)
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("get_weather city=")


def test_the_readme_server_curl_examples_run_as_written(client):
    """The README's curl commands of its server section, verbatim but for the
    address: a completion, and a streamed chat that ends with [DONE]."""
    import subprocess
    [block] = [b for b in re.findall(r"^```sh\n(.*?)^```$", _server_examples(), re.S | re.M)
               if "curl " in b]
    commands = ["curl " + c for c in block.split("\ncurl ")[1:]]    # after `make run`
    assert len(commands) == 2
    host = client.url.removeprefix("http://")
    outputs = []
    for command in commands:
        assert "localhost:8000" in command
        done = subprocess.run(["bash", "-c", command.replace("localhost:8000", host)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    completion = json.loads(outputs[0])
    assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] <= 16
    events = [line[6:] for line in outputs[1].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e)["choices"])


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


def test_tools_reach_a_template_that_does_not_write_them(tmp_path):
    """The default model's template ignores `tools`: Folio writes them into a
    system message of its own (the rendered prompt grows by them, an
    existing system message keeps its text first), says so at start-up, and
    a template that writes tools itself is left alone."""
    from tests.server.conftest import ServerProcess, http
    srv = ServerProcess(["--num-kv-blocks", "256", "--max-model-len", "1024",
                         "--uvicorn-log-level", "warning"])
    try:
        tool = {"type": "function", "function": {
            "name": "record_city", "description": "Record a city",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                           "required": ["name"]}}}
        base = {"model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Record Paris."}]}

        def rendered(**extra):
            status, _, out = http("POST", srv.url + "/tokenize", {**base, **extra})
            assert status == 200, out
            return out["tokens"]
        plain, with_tools = rendered(), rendered(tools=[tool])
        assert len(with_tools) > len(plain) + 20
        status, _, text = http("POST", srv.url + "/detokenize", {"tokens": with_tools})
        prompt = text["prompt"]
        assert "record_city" in prompt and prompt.index("Be brief.") < prompt.index("record_city")
        assert "does not write the tools a request gives" in srv.output()
        forced = {**base, "tools": [tool], "max_tokens": 40, "temperature": 0,
                  "tool_choice": {"type": "function", "function": {"name": "record_city"}}}
        status, _, out = http("POST", srv.url + "/v1/chat/completions", forced)
        assert status == 200, out
        call = out["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "record_city" and "name" in json.loads(call["arguments"])
    finally:
        srv.stop()


def test_a_template_that_writes_tools_is_left_alone():
    from folio.server.tools import template_renders_tools
    from folio.tokenizer import Tokenizer
    from tests.test_tokenizer import _default_gguf
    tok = Tokenizer.from_gguf(_default_gguf())
    writes = ("{% for m in messages %}{{ m.content }}{% endfor %}"
              "{% if tools %}{{ tools | tojson }}{% endif %}")
    ignores = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert template_renders_tools(tok, writes) and not template_renders_tools(tok, ignores)


def test_the_probe_remembers_a_bounded_number_of_templates():
    """Requests may bring templates of their own (--trust-request-chat-template):
    the probe's memory of them stays bounded, the newest kept."""
    from folio.server import tools
    from folio.tokenizer import Tokenizer
    from tests.test_tokenizer import _default_gguf
    tok = Tokenizer.from_gguf(_default_gguf())
    for i in range(tools._RENDERS_TOOLS_KEPT + 20):
        template = "{% for m in messages %}{{ m.content }}{% endfor %}" + f"{{# {i} #}}"
        assert not tools.template_renders_tools(tok, template)
    assert len(tools._renders_tools) <= tools._RENDERS_TOOLS_KEPT
    assert any(f"{{# {tools._RENDERS_TOOLS_KEPT + 19} #}}" in k for k in tools._renders_tools)
