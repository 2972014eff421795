"""Beam search against transformers' `generate(num_beams=k, do_sample=False)`:
the same beams, in the same order, with the same scores."""

import itertools

import pytest
import torch

from folio import LLM, BeamSearchParams, SamplingParams
from folio.engine.llm_engine import LLMEngine
from tests.utils import load_reference_model, make_tiny_model

PROMPTS = [[1, 30, 31, 32, 33], [1, 200, 17, 9], [1] + list(range(50, 70)), [1, 5]]


def reference_beams(model, prompt, width, max_tokens, early_stopping, length_penalty, eos):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                         early_stopping=early_stopping, length_penalty=length_penalty,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))
        beams.append(seq[:end])
    return beams, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("beam"))
    return path, load_reference_model(path)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_matches_transformers_on_a_tiny_model(tiny, width):
    path, ref = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=512, block_size=4)
    eos = llm.get_tokenizer().eos_token_ids
    ended_by_eos = 0
    for prompt, (early, penalty) in zip(PROMPTS, itertools.cycle(
            [(False, 1.0), (True, 0.0), ("never", 2.0), (False, -0.5)])):
        params = BeamSearchParams(beam_width=width, max_tokens=24, early_stopping=early,
                                  length_penalty=penalty)
        out = llm.beam_search({"prompt_token_ids": prompt}, params)[0]
        expected, scores = reference_beams(ref, prompt, width, 24, early, penalty, set(eos))
        assert [o.token_ids for o in out.outputs] == expected, (prompt, early, penalty)
        assert [o.score for o in out.outputs] == pytest.approx(scores, abs=1e-4)
        ended_by_eos += sum(o.finish_reason == "stop" for o in out.outputs)
    assert ended_by_eos > 0                 # the EOS path of the search was exercised
    assert llm.engine.scheduler.kv.num_free_blocks == 512


def test_matches_transformers_on_the_default_model(default_llm, default_reference):
    tok = default_llm.get_tokenizer()
    eos = set(tok.eos_token_ids)
    for question in ["What is the capital of France?", "Name a primary color.", "Say hello."]:
        prompt = tok.encode_chat([{"role": "user", "content": question}])
        out = default_llm.beam_search({"prompt_token_ids": prompt},
                                      BeamSearchParams(beam_width=4, max_tokens=16))[0]
        expected, scores = reference_beams(default_reference, prompt, 4, 16, False, 1.0, eos)
        assert [o.token_ids for o in out.outputs] == expected
        assert [o.score for o in out.outputs] == pytest.approx(scores, abs=1e-4)


def test_beams_share_blocks_and_abort_frees_them(tiny):
    path, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=4)
    engine = llm.engine
    prompt = [1] + list(range(100, 140))                      # 41 tokens: 11 blocks
    engine.add_beam_request("b", None, prompt, BeamSearchParams(beam_width=4, max_tokens=30))
    for _ in range(6):
        engine.step()
    held = engine.scheduler.kv.pool.num_used_blocks
    beams = len(engine.scheduler.requests["b"].live_seqs)
    assert beams == 4 and held < 4 * 11                   # the prompt's blocks are shared
    engine.abort_request(["b"])
    assert engine.scheduler.kv.num_free_blocks == 256
    assert not engine.has_unfinished_requests()


def test_beam_requests_batch_with_others_and_survive_preemption(tiny):
    path, ref = tiny
    from folio import SamplingParams
    tight = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=32)
    prompt = PROMPTS[2]
    engine = tight.engine
    engine.add_beam_request("beam", None, prompt, BeamSearchParams(beam_width=4, max_tokens=20))
    for i in range(3):
        engine.add_request(f"g{i}", {"prompt_token_ids": [1] + list(range(10 + i, 40 + i))},
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    expected, _ = reference_beams(ref, prompt, 4, 20, False, 1.0,
                                  set(tight.get_tokenizer().eos_token_ids))
    assert [o.token_ids for o in finished["beam"].outputs] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.num_free_blocks == 40


def test_invalid_beam_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1e308)


def test_a_failing_beam_step_fails_that_request_alone(tiny, monkeypatch):
    """The scheduler's beam bookkeeping is one request's too: if it raises,
    that request ends with an error and the others finish."""
    import folio.core.scheduler as scheduler_mod      # where the scheduler steps beams
    engine = LLMEngine.from_args(tiny[0], dtype="float32", num_kv_blocks=40, block_size=4)
    real = scheduler_mod.step_beams

    def step(state, *args):
        if state.params.beam_width == 3:
            raise ZeroDivisionError("injected")
        return real(state, *args)

    monkeypatch.setattr(scheduler_mod, "step_beams", step)
    engine.add_beam_request("bad", None, [1, 20, 30], BeamSearchParams(beam_width=3, max_tokens=4))
    engine.add_beam_request("good", None, [1, 20, 30], BeamSearchParams(beam_width=2, max_tokens=4))
    engine.add_tokenized_request("plain", None, [1, 40, 50],
                                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "injected" in done["bad"].error
    assert done["good"].error is None and len(done["good"].outputs) == 2
    assert len(done["plain"].outputs[0].token_ids) == 4
    assert engine.scheduler.kv.num_free_blocks == 40


def test_a_beam_wider_than_max_logprobs_allows_is_a_clear_error(tiny):
    engine = LLMEngine.from_args(tiny[0], dtype="float32", num_kv_blocks=40, max_logprobs=20)
    with pytest.raises(ValueError, match=r"beam_width 11 ranks the top 22 .* max_logprobs \(20"):
        engine.add_beam_request("wide", None, [1, 20], BeamSearchParams(beam_width=11,
                                                                         max_tokens=2))
    assert not engine.has_unfinished_requests()
