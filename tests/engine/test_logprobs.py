"""Sample and prompt logprobs against transformers' log-softmax (fp32, tiny model)."""

import pytest
import torch

from folio import LLM, SamplingParams
from tests.utils import load_reference_model, make_tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("lp"))
    # block size 4 and a 16-token budget: prompts are scored across several chunks
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    return llm, load_reference_model(path)


def reference_logprobs(model, ids):
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)            # row p scores token p + 1


def test_prompt_logprobs_match_reference(setup):
    llm, ref = setup
    prompt = [1] + [(i * 37) % 380 + 3 for i in range(40)]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    expected = reference_logprobs(ref, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        got = out.prompt_logprobs[p]
        assert got[prompt[p]] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=1e-4)
        top_vals, top_ids = expected[p - 1].topk(2)
        for tok, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert got[tok] == pytest.approx(val, abs=1e-4)


def test_sample_logprobs_and_top_k(setup):
    llm, ref = setup
    prompt = [1, 20, 30, 40, 50]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                      logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 6
    expected = reference_logprobs(ref, prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = expected[len(prompt) - 1 + i]
        assert len(entry) == 3 and max(entry, key=entry.get) == token   # greedy: the best one
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs)), abs=1e-5)


def test_prompt_logprobs_survive_preemption(setup):
    """A pool too small for all four requests: preempted ones recompute, yet each
    prompt position is scored exactly once."""
    llm, _ = setup
    small = LLM(llm.engine.config.model.path, dtype="float32", num_kv_blocks=14, block_size=4,
                max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": [1] + [(i * 13 + k) % 380 + 3 for i in range(20)]}
               for k in range(4)]
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  prompt_logprobs=0))
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        assert len(o.prompt_logprobs) == 21 and len(o.outputs[0].token_ids) == 12
