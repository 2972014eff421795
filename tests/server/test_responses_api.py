"""POST /v1/responses (issue 55) through the official `openai` client's
`responses.create` and `responses.stream`, against `folio serve` on the
default model (greedy, with the Hermes tool template): the text is what the
same conversation gets from /v1/chat/completions, streamed or not; a forced
function call comes back as a function_call item with valid arguments; a
JSON schema constrains the text; earlier calls and their outputs are
accepted as input items; what Folio does not keep is refused by name."""

import json
from pathlib import Path

import openai
import pytest

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (a dependency)")

from tests.server.conftest import ServerProcess, http

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "hermes_tool_use.jinja"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks",
                         "256", "--chat-template", str(TEMPLATE),
                         "--uvicorn-log-level", "warning"])
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    c.url = srv.url
    yield c
    srv.stop()


def _chat_text(client, messages, **kw):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                         temperature=0, **kw)
    return out.choices[0].message.content


def test_the_text_is_the_chat_completions(client):
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Name a colour.",
                                instructions="Answer in one word.", temperature=0,
                                max_output_tokens=12)
    expect = _chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                 {"role": "user", "content": "Name a colour."}], max_tokens=12)
    assert r.object == "response" and r.status == "completed" and r.output_text == expect
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_a_stream_gives_the_same_text_in_its_events(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", temperature=0, max_output_tokens=16,
                  input=[{"role": "user", "content": [{"type": "input_text",
                                                       "text": "Say something kind."}]}])
    whole = client.responses.create(**kwargs).output_text
    kinds, deltas = [], []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == whole == final.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert final.usage.output_tokens > 0


def test_a_forced_function_call_is_a_function_call_item(client):
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Weather in Paris?",
                                tools=[WEATHER], tool_choice={"type": "function",
                                                              "name": "get_weather"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    # and the call and its output given back as input items: the model answers
    again = client.responses.create(
        model="SmolLM2-135M-Instruct", tools=[WEATHER], tool_choice="none",
        max_output_tokens=8, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": "18 degrees and sunny"}])
    assert again.status == "completed" and again.output_text


def test_a_streamed_forced_call_comes_whole_as_the_unstreamed_one(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", input="Weather in Rome?", tools=[WEATHER],
                  temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    whole = [i for i in client.responses.create(**kwargs).output if i.type == "function_call"]
    kinds = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
    assert "response.function_call_arguments.done" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")


def test_a_json_schema_constrains_the_text(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="A colour, as JSON.",
                                text={"format": {"type": "json_schema", "name": "colour",
                                                 "schema": schema, "strict": True}},
                                max_output_tokens=40)
    value = json.loads(r.output_text)
    assert set(value) == {"colour"} and isinstance(value["colour"], str)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0]"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
])
def test_what_folio_does_not_do_is_a_400_naming_it(client, body, param):
    status, _, err = http("POST", client.url + "/v1/responses", body)
    assert status == 400 and err["error"]["param"] == param, err
