"""No request field is accepted only to be ignored: each one Folio does not act
on is a 400 naming it, and unknown fields are listed in the log."""

import json
import urllib.request

import pytest

from tests.server.conftest import http

CMPL = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BEAM = {**CMPL, "use_beam_search": True, "n": 2, "best_of": 2}


def refused(server, path: str, body: dict, param: str) -> dict:
    status, _, err = http("POST", server.url + path, body)
    assert status == 400, err
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    return err["error"]


NOT_YET = ["functions", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar",
           "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs",
           "logits_processors", "request_id", "return_tokens_as_token_ids",
           "spaces_between_special_tokens"]
VALUES = {"tool_choice": "auto", "allowed_token_ids": [1, 2], "bad_words": ["x"],
          "truncate_prompt_tokens": 4, "prompt_logprobs": 1, "request_id": "mine",
          "return_tokens_as_token_ids": True, "spaces_between_special_tokens": False}


@pytest.mark.parametrize("path,base", [("/v1/completions", CMPL),
                                       ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("name", NOT_YET)
def test_a_feature_folio_lacks_is_refused_by_name(server, path, base, name):
    err = refused(server, path, {**base, name: VALUES.get(name, {"type": "json_object"})}, name)
    assert err["message"] == f"'{name}' is not supported by Folio yet"


@pytest.mark.parametrize("name", ["tools", "tool_choice"])
def test_tools_are_chat_only(server, name):
    body = {**CMPL, name: VALUES.get(name, [{"type": "function", "function": {"name": "f"}}])}
    err = refused(server, "/v1/completions", body, name)
    assert err["message"] == f"'{name}' is not supported by Folio yet"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**CMPL, "suffix": "!"}, "suffix"),
    ("/v1/completions", {**CMPL, "add_special_tokens": False}, "add_special_tokens"),
    ("/v1/chat/completions", {**CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/v1/chat/completions", {**CHAT, "documents": [{"text": "d"}]}, "documents"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
])
def test_endpoint_specific_features_are_refused(server, path, body, param):
    refused(server, path, body, param)


def test_unused_values_of_those_fields_are_accepted(server):
    for path, base in (("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)):
        body = {**base, "tools": [], "tool_choice": "none", "response_format": None,
                "spaces_between_special_tokens": True}
        assert http("POST", server.url + path, body)[0] == 200
        assert http("POST", server.url + path,
                    {**base, "response_format": {"type": "text"}})[0] == 200


def test_an_explicit_null_is_the_default(server):
    """Clients generated from OpenAI's spec send nullable fields as null."""
    nulls = dict.fromkeys(("n", "stream", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "min_p", "ignore_eos", "seed", "stop",
                           "temperature", "top_p", "user"))
    for path, base, extra in (("/v1/completions", CMPL, {"echo": None}),
                              ("/v1/chat/completions", CHAT, {"logprobs": None})):
        status, _, out = http("POST", server.url + path, {**base, **nulls, **extra})
        assert status == 200, out
        assert len(out["choices"]) == 1


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True}, "use_beam_search",
     "not supported on /v1/chat/completions"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "echo"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("/v1/completions", {**CMPL, "length_penalty": 0.5}, "length_penalty", "use_beam_search"),
    ("/v1/completions", {**CMPL, "early_stopping": True}, "early_stopping", "use_beam_search"),
    ("/v1/chat/completions", {**CHAT, "length_penalty": 2}, "length_penalty", "use_beam_search"),
    ("/v1/completions", {**CMPL, "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {}}, "stream_options", "stream: true"),
    ("/v1/completions", {**CMPL, "priority": 3}, "priority", "--scheduling-policy priority"),
    ("/v1/chat/completions", {**CHAT, "priority": -1}, "priority", "--scheduling-policy"),
    ("/v1/completions", {**CMPL, "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens",
     "max_tokens is 0"),
    ("/v1/completions", {**CMPL, "best_of": 3}, "best_of", "use_beam_search"),
])
def test_a_field_the_request_mode_does_not_read_is_refused(server, path, body, param, needle):
    assert needle in refused(server, path, body, param)["message"]


@pytest.mark.parametrize("name,value", [
    ("temperature", 0.7), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1),
    ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.2),
    ("logit_bias", {"5": 1}), ("stop", ["x"]), ("stop_token_ids", [5]), ("seed", 1),
    ("min_tokens", 1), ("include_stop_str_in_output", True), ("skip_special_tokens", False),
])
def test_beam_search_refuses_the_sampling_fields_it_ignores(server, name, value):
    err = refused(server, "/v1/completions", {**BEAM, name: value}, name)
    assert "not used by beam search" in err["message"]


@pytest.mark.parametrize("extra", [{"stream": True}, {"logprobs": 1}, {"echo": True}])
def test_beam_search_refuses_what_it_cannot_return(server, extra):
    refused(server, "/v1/completions", {**BEAM, **extra}, "use_beam_search")


def test_beam_search_accepts_its_own_fields_and_neutral_values(server):
    body = {**BEAM, "length_penalty": 0.5, "early_stopping": "never", "stop": [],
            "logit_bias": {}, "ignore_eos": True}
    status, _, out = http("POST", server.url + "/v1/completions", body)
    assert status == 200 and len(out["choices"]) == 2


def test_unknown_fields_are_accepted_and_logged_once(server):
    status, _, _ = http("POST", server.url + "/v1/chat/completions",
                        {**CHAT, "store": False, "zz_custom": 1, "metadata": {"a": "b"}})
    assert status == 200
    lines = [ln for ln in server.output().splitlines() if "zz_custom" in ln]
    assert len(lines) == 1 and "ignored: metadata, store, zz_custom" in lines[0]


def test_user_is_accepted(server):
    assert http("POST", server.url + "/v1/completions", {**CMPL, "user": "me"})[0] == 200


def test_chat_template_kwargs_may_repeat_but_not_contradict(server):
    same = {**CHAT, "add_generation_prompt": True,
            "chat_template_kwargs": {"add_generation_prompt": True}}
    assert http("POST", server.url + "/v1/chat/completions", same)[0] == 200
    err = refused(server, "/v1/chat/completions",
                  {**CHAT, "add_generation_prompt": False,
                   "chat_template_kwargs": {"add_generation_prompt": True}},
                  "chat_template_kwargs")
    assert "contradicts" in err["message"]
    err = refused(server, "/v1/chat/completions",
                  {**CHAT, "chat_template_kwargs": {"add_generation_prompt": "x"}},
                  "chat_template_kwargs")
    assert err["message"] == "chat_template_kwargs.add_generation_prompt must be a bool, got 'x'"
    for name in ("messages", "tools", "special_tokens", "template"):
        refused(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {name: 1}},
                "chat_template_kwargs")


def test_chat_template_kwargs_reach_the_template(server):
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = {"messages": CHAT["messages"], "chat_template": template,
            "chat_template_kwargs": {"greeting": "Hey "}, "add_generation_prompt": False}
    _, _, chat = http("POST", server.url + "/tokenize", body)
    _, _, text = http("POST", server.url + "/tokenize", {"prompt": "Hey Hi"})
    assert chat["tokens"] == text["tokens"]


# ---- max_tokens 0 with echo: scoring a prompt
def test_scoring_a_prompt_returns_the_prompt_and_its_logprobs_only(server):
    ids = [1, 30, 31, 32, 33]
    status, _, out = http("POST", server.url + "/v1/completions",
                          {"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True,
                           "logprobs": 1})
    assert status == 200, out
    _, _, detok = http("POST", server.url + "/detokenize", {"tokens": ids})
    choice = out["choices"][0]
    assert choice["text"] == detok["prompt"] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(lp is not None for lp in choice["logprobs"]["token_logprobs"][1:])
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    # the same logprobs as a one-token completion's prompt part
    _, _, one = http("POST", server.url + "/v1/completions",
                     {"model": "tiny", "prompt": ids, "max_tokens": 1, "echo": True,
                      "logprobs": 1, "temperature": 0})
    assert one["choices"][0]["logprobs"]["token_logprobs"][:len(ids)] == \
        choice["logprobs"]["token_logprobs"]


def test_scoring_without_logprobs_and_streamed(server):
    body = {"model": "tiny", "prompt": "Score me", "max_tokens": 0, "echo": True}
    status, _, out = http("POST", server.url + "/v1/completions", body)
    assert status == 200 and out["choices"][0]["text"] == "Score me"
    assert out["choices"][0]["logprobs"] is None
    chunks = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == ["Score me"] and chunks[-1]["usage"]["completion_tokens"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["length"]


def test_max_tokens_zero_without_echo_is_still_a_400(server):
    err = refused(server, "/v1/completions", {**CMPL, "max_tokens": 0}, "max_tokens")
    assert "echo" in err["message"]


# ---- stream_options.continuous_usage_stats
def stream(server, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(server.url + path,
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = [ln.decode().strip()[len("data: "):] for ln in resp if ln.startswith(b"data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path,base", [("/v1/completions", CMPL),
                                       ("/v1/chat/completions", CHAT)])
def test_continuous_usage_rides_on_every_chunk(server, path, base):
    body = {**base, "max_tokens": 4, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream(server, path, body)
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4
    final = chunks[-1]["usage"]
    assert final["total_tokens"] == final["prompt_tokens"] + 4
    plain = stream(server, path, {**base, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain if c["choices"])


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "messages": CHAT["messages"]}, "prompt"),
    ({"messages": CHAT["messages"], "add_special_tokens": False}, "add_special_tokens"),
])
def test_tokenize_refuses_what_it_would_ignore(server, body, param):
    refused(server, "/tokenize", body, param)
