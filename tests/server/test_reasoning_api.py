"""`--reasoning-parser qwen3` through the official `openai` client against `folio
serve` on the default model with Qwen3's own chat template
(tests/fixtures/chat_templates/qwen3.jinja): the thinking goes to
`reasoning_content`, streamed and not alike; `enable_thinking: false` leaves
the answer content; QwQ's template (which ends the prompt inside `<think>`)
makes an answer that never closes its thinking all reasoning; thinking then
a tool call; `include_reasoning: false`. The model is made to write a
thinking answer with a structured-outputs regex (SmolLM2 does not think)."""

from pathlib import Path

import openai
import pytest

pytest.importorskip("xgrammar", reason="the answers are forced with xgrammar (a dependency)")

from folio.server.reasoning import ThinkParser
from tests.server.conftest import ServerProcess, http

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
MODEL = "SmolLM2-135M-Instruct"
THOUGHT, ANSWER = "Oslo is in Norway. It is cold there.", "It is 3 degrees in Oslo."
THINKING = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks",
                         "256", "--chat-template", str(TEMPLATES / "qwen3.jinja"),
                         "--reasoning-parser", "qwen3", "--trust-request-chat-template",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--uvicorn-log-level", "warning"])
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    c.url = srv.url
    yield c
    srv.stop()


def _regex(text):
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)


def _ask(client, stream, forced=None, **kwargs):
    """(reasoning_content, content, tool calls, finish_reason, reasoning chunks)."""
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
              "temperature": 0, "max_tokens": 80, **kwargs}
    if forced is not None:
        kwargs.setdefault("extra_body", {})["structured_outputs"] = {"regex": _regex(forced)}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        m = choice.message
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
        return m.reasoning_content, m.content, calls, choice.finish_reason, None
    reasoning, content, calls, finish, pieces, order = None, None, {}, None, 0, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            d = c.delta
            if getattr(d, "reasoning_content", None):
                reasoning = (reasoning or "") + d.reasoning_content
                pieces += 1
                order.append("r")
            if d.content:
                content = (content or "") + d.content
                order.append("c")
            for t in d.tool_calls or []:
                calls[t.index] = (t.function.name, t.function.arguments)
            finish = c.finish_reason or finish
    assert order == sorted(order, key=lambda k: k != "r"), "reasoning came after content"
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, pieces


@pytest.mark.parametrize("stream", [False, True])
def test_the_thinking_goes_to_reasoning_content(client, stream):
    reasoning, content, calls, finish, pieces = _ask(client, stream, THINKING)
    assert (reasoning, content, calls, finish) == (THOUGHT, ANSWER, [], "stop")
    if stream:
        assert pieces > 1       # the thinking streams as it is written, not at the end


@pytest.mark.parametrize("stream", [False, True])
def test_with_thinking_off_the_answer_is_content(client, stream):
    # Qwen3's template closes an empty <think></think> in the prompt
    reasoning, content, _, finish, _ = _ask(
        client, stream, ANSWER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (reasoning, content, finish) == (None, ANSWER, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_opens_the_thinking_makes_an_unclosed_answer_reasoning(client, stream):
    qwq = (TEMPLATES / "qwq.jinja").read_text()
    reasoning, content, _, finish, _ = _ask(client, stream, max_tokens=12,
                                            extra_body={"chat_template": qwq})
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], temperature=0,
        max_tokens=12, extra_body={"chat_template": qwq, "include_reasoning": False})
    # the same greedy answer: all of it thinking, none of it content
    assert reasoning and reasoning == reasoning.strip() and content is None
    assert plain.choices[0].message.content is None
    assert finish == plain.choices[0].finish_reason


def test_a_constrained_answer_after_an_open_thinking_prompt_is_content(client):
    qwq = (TEMPLATES / "qwq.jinja").read_text()
    reasoning, content, _, finish, _ = _ask(client, False, '{"city": "Oslo"}',
                                            extra_body={"chat_template": qwq})
    assert (reasoning, content, finish) == (None, '{"city": "Oslo"}', "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_a_tool_call(client, stream):
    reasoning, content, calls, finish, _ = _ask(client, stream, f"<think>\n{THOUGHT}\n</think>"
                                                f"\n\n{CALL}", tools=TOOLS)
    assert (reasoning, calls, finish) == (THOUGHT, [("get_weather", '{"city": "Oslo"}')],
                                          "tool_calls")
    assert not content


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_the_thinking(client, stream):
    reasoning, content, _, _, _ = _ask(client, stream, THINKING,
                                       extra_body={"include_reasoning": False})
    assert (reasoning, content) == (None, ANSWER)


def test_the_thinking_reaches_the_next_turn_through_the_template(client):
    """An earlier answer's reasoning_content, sent back in OpenAI's form, is
    rendered by Qwen3's template as its <think> block."""
    status, _, body = http("POST", client.url + "/tokenize", {"model": MODEL, "messages": [
                            {"role": "user", "content": "Weather in Oslo?"},
                            {"role": "assistant", "content": ANSWER,
                             "reasoning_content": THOUGHT}],
                            "add_generation_prompt": False})
    assert status == 200
    shown = client.completions.create(model=MODEL, prompt=body["tokens"], max_tokens=1,
                                      echo=True).choices[0].text
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n{ANSWER}" in shown


ANSWERS = [THINKING, f"  <think>{THOUGHT}</think>{ANSWER}", "<think>\ncut before its end",
           "no thinking here", "<thi", " ", "<think>a</thinking></think> b",
           f"<think>\n{THOUGHT}\n</think>\n\n{CALL}"]


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("answer", ANSWERS)
def test_every_partial_split_is_the_start_of_the_final_one(answer, inside):
    """What a stream sends from a growing answer is never taken back."""
    p = ThinkParser(inside)
    final = p.split(answer)
    for n in range(len(answer) + 1):
        part = p.split(answer[:n], final=False)
        assert (final.reasoning or "").startswith(part.reasoning or ""), (n, part)
        assert final.content.startswith(part.content), (n, part)


def test_the_split():
    p = ThinkParser()
    assert (p.split(THINKING).reasoning, p.split(THINKING).content) == (THOUGHT, ANSWER)
    assert p.split("no thinking here").reasoning is None
    assert p.split("  no thinking").content == "  no thinking"     # content left as it is
    cut = p.split("<think>\ncut before its end")
    assert (cut.reasoning, cut.content, cut.thinking) == ("cut before its end", "", True)
    inside = ThinkParser(inside=True).split(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    assert (inside.reasoning, inside.content) == (THOUGHT, ANSWER)
    # a model that writes <think> again after a prompt that opened it: the tag goes
    again = ThinkParser(inside=True).split(THINKING)
    assert (again.reasoning, again.content) == (THOUGHT, ANSWER)
    # growing: a tail that may begin </think> or <think> is held back
    assert p.split("<think>\nabc </thi", final=False).reasoning == "abc"
    assert p.split("<thi", final=False).content == ""


def test_the_answer_validates_against_the_published_models(client):
    from folio.server import responses as r
    status, _, body = http("POST", client.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
        "structured_outputs": {"regex": _regex(THINKING)}})
    assert status == 200
    answer = r.ChatCompletionResponse.model_validate(body)
    assert answer.choices[0].message.reasoning_content == THOUGHT
