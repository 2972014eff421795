"""Tensor parallelism over torch.distributed (gloo on the CPU): the same greedy
tokens as one rank, clear errors for impossible splits, and a dead worker
failing requests quickly with no process left behind; a failed start leaves
no worker and no process group, so the next engine starts."""

import multiprocessing as mp
import shutil
import time

import pytest
import torch.distributed as dist

from folio import LLM, SamplingParams
from folio.worker.multiproc import MultiprocExecutor
from tests.utils import make_tiny_model
from tests.worker.ranks import kill_a_worker_mid_run

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 2 layers, 4 heads, 2 KV heads: tp=4 replicates the KV heads
    return make_tiny_model(tmp_path_factory.mktemp("tp"))


def prompts():
    return [{"prompt_token_ids": [1, 20 + i, 30, 40, 50 + i] * (i + 1)} for i in range(4)]


def test_tp2_and_tp4_match_one_rank(tiny):
    expected = [o.outputs[0].token_ids for o in
                LLM(tiny, dtype="float32", num_kv_blocks=64).generate(prompts(), PARAMS)]
    for tp in (2, 4):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS)]
        finally:
            llm.shutdown()
        assert got == expected, tp
        assert not any(w.is_alive() for w in llm.engine.executor.workers)


def test_default_model_tp3(default_llm):
    chats = [{"prompt_token_ids": default_llm.get_tokenizer().encode_chat(
        [{"role": "user", "content": q}])} for q in ["Hi!", "What is 2+2?", "Name a fruit.",
                                                     "Say something kind."]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(chats, params)]
    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=2048, tensor_parallel_size=3)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(chats, params)]
    finally:
        llm.shutdown()
    assert got == expected


def test_structured_outputs_under_tp2_match_one_rank(tiny):
    """Rank 0 samples under the grammar; the workers get the request's params
    without the compiled grammar (it is not pickled) and never need it."""
    import re
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (a dependency)")
    params = [SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs={"regex": r"[a-e ]{3,8}"}),
              SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=12,
                             structured_outputs={"choice": ["yes", "no"]})]
    runs = []
    for tp in (1, 2):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            outs = llm.generate(prompts()[:2], params)
        finally:
            llm.shutdown()
        runs.append([[o.text for o in out.outputs] for out in outs])
    assert runs[0] == runs[1]
    (regex,), choices = runs[0]
    assert re.fullmatch(r"[a-e ]{3,8}", regex) and set(choices) <= {"yes", "no"}


def test_impossible_splits_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="4 attention heads cannot be split across "
                                         "tensor_parallel_size=3"):
        LLM(tiny, dtype="float32", num_kv_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=8"):
        LLM(tiny, dtype="float32", num_kv_blocks=16, tensor_parallel_size=8)
    with pytest.raises(ValueError, match="mp or ray"):
        LLM(tiny, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2,
            distributed_executor_backend="mpi")


def test_a_dead_worker_fails_requests_fast_and_leaves_nothing(tiny):
    kill_a_worker_mid_run(LLM(tiny, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2))


def truncated_copy(tiny, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(tiny, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return bad


def test_a_failed_start_leaves_nothing_and_the_next_engine_starts(tiny, tmp_path):
    bad = truncated_copy(tiny, tmp_path)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"{bad / 'model.safetensors'} is not a readable "
                                         "safetensors file"):
        LLM(str(bad), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert not dist.is_initialized()
    assert not [p for p in mp.active_children() if p.name.startswith("folio-rank")]
    expected = [o.outputs[0].token_ids for o in
                LLM(tiny, dtype="float32", num_kv_blocks=64).generate(prompts(), PARAMS)]
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS)] == expected
    finally:
        llm.shutdown()


def test_a_worker_that_fails_to_start_is_named_with_its_error():
    parent, child = mp.Pipe()
    child.send(("failed", "MemoryError: no room for the shard", False))
    with pytest.raises(RuntimeError, match="rank 1 failed to start: MemoryError: no room"):
        MultiprocExecutor._started(1, parent)
    child.send(("failed", "FileNotFoundError: /models/x", True))     # the user's to fix
    with pytest.raises(ValueError, match="rank 1 failed to start: FileNotFoundError"):
        MultiprocExecutor._started(1, parent)
    child.send(7)
    assert MultiprocExecutor._started(1, parent) == 7
    child.close()
    with pytest.raises(RuntimeError, match="rank 2 exited while starting"):
        MultiprocExecutor._started(2, parent)
