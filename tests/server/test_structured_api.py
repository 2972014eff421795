"""Structured outputs through the official `openai` client against `folio
serve` on the default model: `parse` with Pydantic models, json_object,
regex and choice on every sample of n=4, and the 400s of constraints that
cannot be compiled. Strings and arrays in the schemas are bounded, so that a
greedy answer always ends within max_tokens on any CPU's numerics."""

import json
import re
from enum import Enum
from typing import Annotated, Optional

import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (a dependency)")

from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks",
                         "256", "--served-model-name", "smol", "--uvicorn-log-level", "warning"])
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


class Trip(BaseModel):
    destination: City                                  # nested object
    stops: list[Annotated[str, Field(max_length=12)]] = Field(min_length=2, max_length=3)
    colour: Colour                                     # an enum
    note: Optional[str] = Field(None, max_length=20)   # optional
    days: int = Field(ge=1, le=14)                     # bounds


class Score(BaseModel):
    player: str = Field(max_length=16)
    points: int = Field(ge=0, le=100)
    tags: list[Colour] = Field(min_length=1, max_length=2)


def ask(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("model, question", [
    (City, "Describe Paris."),
    (Trip, "Plan a short trip to Rome."),
    (Score, "A player scored 42 points."),
])
def test_parse_returns_the_object(client, model, question):
    done = client.chat.completions.parse(model="smol", messages=ask(question),
                                         response_format=model, temperature=0, max_tokens=300)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, model)
    assert model.model_validate_json(choice.message.content) == parsed


def test_json_object_parses(client):
    done = client.chat.completions.create(
        model="smol", messages=ask('Reply with a JSON object with the keys "city" and '
                                   '"country" for Paris.'),
        response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    assert isinstance(json.loads(done.choices[0].message.content), dict)


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
    ({"choice": ["cat", "dog", "bird"]}, lambda t: t in ("cat", "dog", "bird")),
])
def test_regex_and_choice_on_every_sample(client, constraint, check):
    chat = client.chat.completions.create(
        model="smol", messages=ask("What time is it, or which pet?"), n=4, temperature=1.0,
        seed=7, max_tokens=20, extra_body={"structured_outputs": constraint})
    done = client.completions.create(model="smol", prompt="Answer:", n=4, temperature=1.0,
                                     seed=7, max_tokens=20,
                                     extra_body={"structured_outputs": constraint})
    texts = [c.message.content for c in chat.choices] + [c.text for c in done.choices]
    assert len(texts) == 8 and all(check(t) for t in texts), texts


def test_logprobs_of_forbidden_tokens_are_a_floor_not_minus_infinity(client):
    """Under a choice only one token may follow "c": its top logprobs hold
    tokens the grammar forbids, at -9999 (vLLM's floor), as JSON can hold it."""
    constraint = {"structured_outputs": {"choice": ["cat", "dog"]}}
    done = client.completions.create(model="smol", prompt="Answer:", max_tokens=5, logprobs=3,
                                     temperature=0, extra_body=constraint)
    lp = done.choices[0].logprobs
    assert done.choices[0].text in ("cat", "dog")
    assert -9999.0 in [v for top in lp.top_logprobs for v in top.values()]
    assert all(v >= -9999.0 for top in lp.top_logprobs for v in top.values())
    chat = client.chat.completions.create(model="smol", messages=ask("Pet?"), max_tokens=5,
                                          logprobs=True, top_logprobs=3, temperature=0,
                                          extra_body=constraint)
    assert -9999.0 in [t.logprob for e in chat.choices[0].logprobs.content
                       for t in e.top_logprobs]


def test_a_streamed_constrained_answer_is_the_unstreamed_one(client):
    kwargs = dict(model="smol", messages=ask("Describe Paris."), temperature=0, max_tokens=120,
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "city", "schema": City.model_json_schema()}})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full and City.model_validate_json(full)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "json cannot be compiled"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "one of response_format and structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_constraints_are_a_400(client, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=ask("Hi"), max_tokens=4,
                                       extra_body=body)
    assert message in str(e.value)


def test_beam_search_with_a_constraint_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="do not work with beam search"):
        client.completions.create(model="smol", prompt="Hi", max_tokens=4, n=2,
                                  extra_body={"use_beam_search": True,
                                              "structured_outputs": {"regex": "a+"}})
