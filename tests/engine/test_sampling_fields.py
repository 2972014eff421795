"""SamplingParams fields end to end on a tiny model."""

import pytest
import torch

from folio import LLM, SamplingParams
from tests.utils import load_reference_model, make_tiny_model

PROMPT = {"prompt_token_ids": [1, 20, 21, 22, 23, 24, 25]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fields"))
    return LLM(path, dtype="float32", num_kv_blocks=64, block_size=4), path


def greedy(llm, **kw):
    params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    params.update(kw)
    return llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0]


def test_repetition_penalty_matches_transformers(setup):
    llm, path = setup
    ref = load_reference_model(path)
    ref.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT["prompt_token_ids"]])
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=10, repetition_penalty=1.5, pad_token_id=0)
    assert greedy(llm, repetition_penalty=1.5).token_ids == expected[0, ids.shape[1]:].tolist()


def test_frequency_penalty_discourages_repeats(setup):
    llm, _ = setup
    plain = greedy(llm, max_tokens=24).token_ids
    penalized = greedy(llm, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0).token_ids
    assert len(set(penalized)) >= len(set(plain))


def test_logit_bias_forces_a_token(setup):
    llm, _ = setup
    assert greedy(llm, logit_bias={77: 100.0}).token_ids == [77] * 10


def test_min_tokens_holds_back_stops(setup):
    llm, _ = setup
    first = greedy(llm).token_ids[0]
    stopped = greedy(llm, stop_token_ids=[first], max_tokens=10)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = greedy(llm, stop_token_ids=[first], min_tokens=4, max_tokens=10)
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_include_stop_str_in_output(setup):
    llm, _ = setup
    text = greedy(llm, max_tokens=16).text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    cut = text.find(stop)
    assert greedy(llm, max_tokens=16, stop=[stop]).text == text[:cut]
    kept = greedy(llm, max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:cut + len(stop)] and kept.stop_reason == stop


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                         ("repetition_penalty", 0.0), ("min_p", -0.1),
                                         ("min_tokens", -1), ("logit_bias", {1: 500})])
def test_invalid_fields(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})


def test_logit_bias_outside_vocab(setup):
    llm, _ = setup
    with pytest.raises(ValueError, match="logit_bias token id 5000"):
        llm.generate(PROMPT, SamplingParams(logit_bias={5000: 1.0}))
