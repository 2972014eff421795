"""The request models map onto SamplingParams by name: every sampling field
reaches the engine as the client sent it, and a field added to SamplingParams
that the API lacks is caught here."""

import dataclasses

import pytest

from folio.sampling_params import SamplingParams
from folio.server.protocol import _SAMPLING_FIELDS, ChatCompletionRequest, CompletionRequest

# a value other than the default for every mapped field
CHANGED = {"n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11, "stop": ["END"],
           "stop_token_ids": [3], "ignore_eos": True, "skip_special_tokens": False,
           "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.5,
           "min_p": 0.1, "logit_bias": {"5": 2.0}, "min_tokens": 2,
           "include_stop_str_in_output": True, "structured_outputs": {"regex": "[ab]+"}}


def test_every_sampling_field_but_the_derived_three_is_mapped():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(_SAMPLING_FIELDS) == names - {"max_tokens", "logprobs", "prompt_logprobs"}
    assert set(CHANGED) == set(_SAMPLING_FIELDS), "give the new field a changed value here"


@pytest.mark.parametrize("cls,extra", [
    (CompletionRequest, {"prompt": "hi"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
def test_the_request_carries_each_field_by_name(cls, extra):
    missing = [name for name in _SAMPLING_FIELDS if name not in cls.model_fields]
    assert not missing, f"{cls.__name__} lacks {missing}"
    got = cls(model="m", **extra, **CHANGED).sampling_params(5, 1, 0)
    expected = SamplingParams(**CHANGED, max_tokens=5, logprobs=1, prompt_logprobs=0)
    assert got == expected
    # null is the default
    plain = cls(model="m", **extra, temperature=None, top_p=None, top_k=None, seed=None,
                stop=None, stop_token_ids=None).sampling_params(5, None)
    assert plain == SamplingParams(max_tokens=5)
