"""The runner's contract with the scheduler, on a tiny model."""

import pytest
import torch

from folio import LLM, SamplingParams
from folio.core.outputs import SamplingInfo, ScheduledSeq, SchedulerOutput
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("runner"))


def test_blocks_to_copy_run_before_the_forward(tiny):
    """Copy-on-write groundwork: a copied block holds the source's keys and values
    in every layer, and a sequence reading the copy gets the same next token."""
    llm = LLM(tiny, dtype="float32", num_kv_blocks=8, block_size=4)
    runner = llm.engine.executor.runner
    greedy = SamplingInfo(SamplingParams(temperature=0))
    prompt = [5, 6, 7, 8, 9, 10, 11]       # 2 blocks: [0, 1]
    first = runner.execute(SchedulerOutput(seqs=[ScheduledSeq(
        seq_id=100, token_ids=prompt, start_pos=0, new_block_ids=[0, 1], block_ids=[0, 1],
        sampling=greedy)]))
    # Sequence 101 shares block 0 and takes a copy of block 1 into block 5.
    second = runner.execute(SchedulerOutput(blocks_to_copy=[(1, 5)], seqs=[ScheduledSeq(
        seq_id=101, token_ids=prompt[-1:], start_pos=6, new_block_ids=[0, 5], block_ids=[0, 5],
        sampling=greedy)], finished_seq_ids=[100]))
    for cache in runner.kv_caches:
        assert torch.equal(cache[:, 5, :2], cache[:, 1, :2])
    assert second.token_ids == first.token_ids
    runner.execute(SchedulerOutput(finished_seq_ids=[101]))
    assert not runner.states


def test_float64_runs_and_agrees_with_float32(tiny):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 40, 41, 42, 43]}
    out64 = LLM(tiny, dtype="float64", num_kv_blocks=16).generate(prompt, params)[0]
    out32 = LLM(tiny, dtype="float32", num_kv_blocks=16).generate(prompt, params)[0]
    assert out64.outputs[0].token_ids == out32.outputs[0].token_ids


def test_float16_is_refused_on_cpu(tiny):
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        LLM(tiny, dtype="float16", device="cpu")
