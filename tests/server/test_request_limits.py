"""No request holds the server for long (issue 34): --max-tokens-default,
--max-tokens-limit and --request-timeout, a json_schema without a schema, and
"any JSON" whose numbers end.

On the default model (SmolLM2-135M, 8192 tokens of context): a request that
gives no max_tokens would otherwise generate until the context is full, some
minutes on a 2-core CPU; under an "any JSON" constraint the model wrote one
number for 8,181 tokens.
"""

import json
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.server.conftest import ServerProcess, http, wait_for
from tests.server.test_lifecycle import metrics

LIMIT, DEFAULT, TIMEOUT = 200, 160, 3.0
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--served-model-name", "smol", "--num-kv-blocks", "1024",
                         "--max-tokens-default", str(DEFAULT), "--max-tokens-limit", str(LIMIT),
                         "--uvicorn-log-level", "warning"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def slow_server():
    """No token limit, a timeout: a request without max_tokens runs ~8,000 tokens."""
    srv = ServerProcess(["--served-model-name", "smol", "--num-kv-blocks", "1024",
                         "--request-timeout", str(TIMEOUT), "--uvicorn-log-level", "warning"])
    yield srv
    srv.stop()


def chat(text: str, **fields) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": text}], **fields}


def idle(srv) -> bool:
    m = metrics(srv)
    return m["folio:num_requests_running"] == 0 and m["folio:kv_cache_usage_perc"] == 0


CONSTRAINTS = {
    "none": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema {}": {"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "a", "schema": {}}}},
    "a string": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "string"}}}},
    "regex of digits": {"structured_outputs": {"regex": "[0-9]+"}},
}


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_a_request_without_max_tokens_ends_within_the_cap_beside_another(server, constraint):
    """The hostile case: no max_tokens, EOS ignored (so only a limit or the
    grammar's end can stop it), under each constraint, streamed; a second
    request sent once the first has begun is answered while the first runs."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    seen = {"chunks": 0, "begun": threading.Event()}

    def hostile():
        fields = dict(CONSTRAINTS[constraint], ignore_eos=True)
        for chunk in client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Write a long number."}],
                stream=True, stream_options={"include_usage": True}, extra_body=fields):
            if chunk.choices and chunk.choices[0].finish_reason:
                seen["finish"] = chunk.choices[0].finish_reason
            if chunk.usage:
                seen["tokens"] = chunk.usage.completion_tokens
            seen["chunks"] += 1
            seen["begun"].set()
        seen["ended"] = time.monotonic()

    t = threading.Thread(target=hostile)
    t.start()
    assert seen["begun"].wait(60)
    status, _, other = http("POST", server.url + CHAT, chat("Say hi", max_tokens=4))
    answered = time.monotonic()
    t.join(120)
    assert status == 200 and other["usage"]["completion_tokens"] <= 4
    # the default applies to a request that asks for nothing; a grammar may end it sooner
    assert 1 <= seen["tokens"] <= DEFAULT
    if seen["finish"] == "length":
        assert seen["tokens"] == DEFAULT
        assert answered < seen["ended"]         # served alongside, not after
    if constraint in ("none", "regex of digits"):     # nothing but the cap ends these
        assert seen["finish"] == "length"
    assert wait_for(lambda: idle(server))


def test_min_tokens_above_the_default_raises_the_budget(server):
    """Chat without max_tokens: not "min_tokens must not exceed max_tokens (160)"."""
    status, _, body = http("POST", server.url + CHAT, chat("Once", min_tokens=DEFAULT + 10,
                                                           ignore_eos=True))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == DEFAULT + 10


def test_max_tokens_above_the_limit_is_a_400_and_at_it_runs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=LIMIT + 1)
    assert e.value.status_code == 400 and "--max-tokens-limit" in str(e.value)
    assert f"at most {LIMIT} tokens" in str(e.value)
    done = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=LIMIT,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == LIMIT and done.choices[0].finish_reason == "length"


def test_a_json_schema_without_its_schema_is_a_400(server):
    status, _, body = http("POST", server.url + CHAT, chat("x", response_format={
        "type": "json_schema", "json_schema": {"name": "a"}}))
    assert status == 400, body
    assert "json_schema needs a schema" in body["error"]["message"]
    assert body["error"]["param"] == "response_format"


def test_any_json_numbers_end(server):
    """Digits pushed by logit_bias: under "any JSON" a number stops at 16 digits
    before the point, 16 after and 3 in the exponent, so the answer ends ("stop")
    long before any limit; it parses."""
    status, _, tok = http("POST", server.url + "/tokenize", {"model": "smol", "prompt": "7"})
    [seven] = [t for t in tok["tokens"]]
    status, _, body = http("POST", server.url + CHAT, chat(
        "A number:", max_tokens=LIMIT, logit_bias={str(seven): 30},
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}))
    assert status == 200, body
    choice = body["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", text
    value = json.loads(text)
    assert isinstance(value, (int, float)) and "7" * 16 in text and "7" * 17 not in text


def test_a_request_past_the_timeout_is_aborted_with_a_504(slow_server):
    t0 = time.monotonic()
    status, _, body = http("POST", slow_server.url + CHAT, chat("Tell me a long story.",
                                                                ignore_eos=True), timeout=120)
    took = time.monotonic() - t0
    assert status == 504, body
    assert "--request-timeout of 3 s" in body["error"]["message"]
    assert TIMEOUT <= took < TIMEOUT + 5
    assert wait_for(lambda: idle(slow_server))
    # the openai client with its default retries: told not to retry the 504
    client = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused")
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="smol", messages=[
            {"role": "user", "content": "Tell me a long story."}], extra_body={"ignore_eos": True})
    assert e.value.status_code == 504 and time.monotonic() - t0 < 2 * TIMEOUT
    # streamed: the text so far, then the error event, then [DONE]
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Tell me a story."}],
                stream=True, extra_body={"ignore_eos": True}):
            got.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
    assert "--request-timeout" in str(e.value) and "".join(got)
    assert wait_for(lambda: idle(slow_server))
    # the server goes on serving
    status, _, body = http("POST", slow_server.url + CHAT, chat("Hi", max_tokens=3))
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_a_default_above_the_limit_is_refused_at_start():
    proc = subprocess.run([sys.executable, "-m", "folio.cli", "serve", "--max-tokens-default",
                           "100", "--max-tokens-limit", "10"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "folio: error: --max-tokens-default (100) is above --max-tokens-limit (10)")
