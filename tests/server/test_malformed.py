"""Every malformed input is a 4xx naming its field, never a 500 (issue 52):
text that is not Unicode (a lone surrogate), a role no chat has, a schema
with no output at all (refused when compiled), and a constraint that
dead-ends while it runs (one character of regex under min_tokens 16),
with no proposals, n-gram proposals and a draft model's: the request ends with a 400 (an error
event in a stream), the server keeps serving, no block stays held."""

import json

import pytest

from tests.server.conftest import ServerProcess, http, tiny_server_args
from tests.server.test_lifecycle import metrics

C, H = "/v1/completions", "/v1/chat/completions"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1})


@pytest.fixture(scope="module", params=["plain", "ngram", "draft"])
def server(tiny_model, request):
    """No proposals, n-gram proposals, and the model drafting for itself."""
    draft = json.dumps({"method": "draft_model", "model": tiny_model,
                        "num_speculative_tokens": 3})
    extra = {"plain": [], "ngram": ["--speculative-config", NGRAM],
             "draft": ["--speculative-config", draft]}[request.param]
    srv = ServerProcess(tiny_server_args(tiny_model) + extra)
    yield srv
    srv.stop()


def raw_post(server, path: str, text: str):
    """A body written by hand: json.dumps would not write a lone surrogate escape."""
    return http("POST", server.url + path, raw=text.encode())


def assert_400(answer, param=None, words=""):
    status, _, body = answer
    assert status == 400, body
    assert body["error"]["code"] == 400 and words in body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param, body


def test_a_lone_surrogate_is_a_400_naming_its_field(server):
    assert_400(raw_post(server, C, '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
               "prompt", "lone UTF-16 surrogate")
    assert_400(raw_post(server, H, '{"model": "tiny", "max_tokens": 2, "messages": '
                                   '[{"role": "user", "content": "\\udfff"}]}'),
               "messages[0].content", "lone UTF-16 surrogate")
    assert_400(raw_post(server, C, '{"model": "tiny", "prompt": "x", "stop": ["\\ud83d"]}'),
               "stop[0]", "lone UTF-16 surrogate")
    # a pair is a character: served
    status, _, _ = raw_post(server, C, '{"model": "tiny", "prompt": "\\ud83d\\ude00", '
                                       '"max_tokens": 2}')
    assert status == 200


def test_an_unknown_role_is_a_400(server):
    for role in ("hacker", None, 5):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": role, "content": "x"}]}
        assert_400(http("POST", server.url + H, body), "messages[0].role", "role")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"},
                                          {"role": "hacker", "content": "y"}]}
    assert_400(http("POST", server.url + "/tokenize", body), "messages[1].role")


def test_a_schema_with_no_output_is_refused_when_compiled(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    body = {"model": "tiny", "max_tokens": 4, "response_format": fmt,
            "messages": [{"role": "user", "content": "hi"}]}
    assert_400(http("POST", server.url + H, body), words="accepts no output at all")


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_dead_ends_ends_its_request_with_a_400(server, stream):
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 20, "min_tokens": 16,
            "structured_outputs": {"regex": "a"}, "stream": stream}
    status, _, answer = http("POST", server.url + C, body)
    if not stream:
        assert_400((status, None, answer), words="min_tokens bans ending")
    else:
        assert status == 200
        events = [json.loads(line[6:]) for line in answer.splitlines()
                  if line.startswith("data: {")]
        error = events[-1]["error"]
        assert error["code"] == 400 and "min_tokens bans ending" in error["message"], events
    # the server goes on: the next request runs, every block is free
    status, _, out = http("POST", server.url + C, {"model": "tiny", "prompt": "Hello",
                                                   "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    m = metrics(server)
    assert m["folio:num_requests_running"] == 0 and m["folio:kv_cache_usage_perc"] == 0.0
    assert http("GET", server.url + "/health")[0] == 200
