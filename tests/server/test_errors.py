"""Every bad input gets its status and OpenAI's error shape; the server then
answers a good request normally."""

import pytest

from tests.server.conftest import http

GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


def good_still_works(server):
    status, _, body = http("POST", server.url + "/v1/completions", GOOD)
    assert status == 200 and body["choices"][0]["text"] is not None


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "empty"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "max_logprobs"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 300}, 400, "300"),
    ("/v1/completions", {**GOOD, "max_tokens": 500}, 400, "maximum context length is 256"),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_schema"}}, 400,
     "response_format json_schema needs its json_schema"),
    ("/v1/completions", {**GOOD, "logit_bias": {"99999": 10}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"x": 10}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {**GOOD, "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {**GOOD, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {**GOOD, "n": 17}, 400, "n: Input should be less than or equal to 16"),
    ("/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "gpt-9"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
    ("/v1/nowhere", {}, 404, "no route"),
])
def test_bad_input(server, path, body, status, needle):
    got, headers, err = http("POST", server.url + path, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert needle in err["error"]["message"] or needle == err["error"]["param"]
    assert "x-request-id" in {k.lower() for k in headers}
    good_still_works(server)


def test_malformed_json_is_400(server):
    got, _, err = http("POST", server.url + "/v1/completions", raw=b"{not json")
    assert got == 400 and err["error"]["code"] == 400
    good_still_works(server)


def test_bad_input_mid_stream_shape(server):
    """Errors found before streaming starts are plain 400s, not event streams."""
    got, _, err = http("POST", server.url + "/v1/completions", {**GOOD, "stream": True,
                                                                "top_p": 0})
    assert got == 400 and "top_p" in err["error"]["message"]
