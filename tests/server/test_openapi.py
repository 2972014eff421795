"""/openapi.json tells the truth: real schemas and the statuses the server
answers, and the server's real answers validate against its response models."""

import json
import urllib.request

import pytest

from folio.server import responses as r
from tests.server.conftest import http

ERROR_REF = "#/components/schemas/ErrorResponse"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def doc(server):
    status, _, body = http("GET", server.url + "/openapi.json")
    assert status == 200
    return body


def operations(doc):
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield f"{method.upper()} {path}", op


def test_every_operation_has_real_schemas_and_statuses(doc):
    schemas = doc["components"]["schemas"]
    seen = {}
    for name, op in operations(doc):
        seen[name] = set(op["responses"])
        assert "422" not in op["responses"], name           # validation errors are 400s
        for status, response in op["responses"].items():
            for media, content in (response.get("content") or {}).items():
                schema = content["schema"]
                assert schema, f"{name} {status} {media}: empty schema"
                if "$ref" in schema:
                    assert schema["$ref"].rsplit("/", 1)[1] in schemas, schema
                if status != "200":
                    assert schema == {"$ref": ERROR_REF}, (name, status)
    generation = {"200", "400", "401", "404", "429", "500", "503"}
    assert seen["POST /v1/completions"] == seen["POST /v1/chat/completions"] == generation
    assert seen["POST /tokenize"] == seen["POST /detokenize"] == {"200", "400", "401", "404",
                                                                  "503"}
    assert seen["GET /v1/models"] == {"200", "401", "503"}
    assert seen["GET /v1/usage"] == {"200", "400", "401", "403", "404"}
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas


def test_health_documents_an_empty_200(doc, server):
    responses = doc["paths"]["/health"]["get"]["responses"]
    assert "content" not in responses["200"]
    assert responses["503"]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
    with urllib.request.urlopen(server.url + "/health") as resp:
        assert resp.status == 200 and resp.read() == b""


def test_request_schemas_are_the_models(doc):
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    streamed = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert streamed["text/event-stream"]["schema"]["$ref"].endswith("CompletionStreamResponse")


@pytest.mark.parametrize("method,path,body,model", [
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3}, r.CompletionResponse),
    ("POST", "/v1/completions", {"prompt": [1, 30, 31], "max_tokens": 2, "echo": True,
                                 "logprobs": 2, "n": 2}, r.CompletionResponse),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 1},
     r.CompletionResponse),
    ("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "logprobs": True,
                                      "top_logprobs": 2}, r.ChatCompletionResponse),
    ("GET", "/v1/models", None, r.ModelList),
    ("POST", "/tokenize", {"prompt": "Hi"}, r.TokenizeResponse),
    ("POST", "/tokenize", {"messages": MSGS}, r.TokenizeResponse),
    ("POST", "/detokenize", {"tokens": [30, 31]}, r.DetokenizeResponse),
    ("GET", "/version", None, r.VersionResponse),
    ("POST", "/v1/chat/completions/render", {"messages": MSGS}, r.RenderedPrompt),
    ("GET", "/get_load", None, r.LoadResponse),
    ("GET", "/get_model_info", None, r.ModelInfoResponse),
])
def test_answers_validate_against_the_models(server, method, path, body, model):
    status, _, got = http(method, server.url + path, body)
    assert status == 200, got
    model.model_validate(got)


def test_a_completion_render_is_a_list_of_the_model(server):
    status, _, got = http("POST", server.url + "/v1/completions/render", {"prompt": ["Hi", "x"]})
    assert status == 200 and len(got) == 2
    for item in got:
        r.RenderedPrompt.model_validate(item)


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/chat/completions/render", {"messages": MSGS, "model": "nope"}, 404),
    ("POST", "/v1/completions/render", {"prompt": []}, 400),
])
def test_render_errors(server, method, path, body, status):
    got, _, err = http(method, server.url + path, body)
    assert got == status
    assert r.ErrorResponse.model_validate(err).error.code == status


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/completions", {"prompt": "Hi", "top_p": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "Hi", "model": "nope"}, 404),
    ("POST", "/v1/completions", None, 400),
    ("GET", "/v1/nowhere", None, 404),
    ("PUT", "/v1/completions", {}, 405),
])
def test_errors_validate_against_the_error_model(server, method, path, body, status):
    got, _, err = http(method, server.url + path, body)
    assert got == status
    assert r.ErrorResponse.model_validate(err).error.code == status


def _events(server, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [ln.decode().strip() for ln in resp]
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_stream_chunks_validate_against_the_models(server):
    usage = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _events(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                 "logprobs": 1, "stream_options": usage})
    for chunk in chunks:
        r.CompletionStreamResponse.model_validate(chunk)
    chunks = _events(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3,
                                                      "stream": True, "stream_options": usage})
    for chunk in chunks:
        r.ChatCompletionStreamResponse.model_validate(chunk)
