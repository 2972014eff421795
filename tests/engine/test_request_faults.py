"""A fault in one request's step fails that request alone: the others get the
answers they would have had, the engine keeps serving, no block leaks.

The fault comes from the runner's test-only hook, at the two places where one
sequence's inputs meet the batch: preparing its state, and sampling its row.
"""

import asyncio

import pytest

from folio import LLM, SamplingParams
from folio.engine.async_engine import AsyncLLMEngine, RequestFailedError
from folio.engine.llm_engine import LLMEngine
from tests.utils import make_tiny_model

MARK = 333          # the failing request's prompt starts with this token
PROMPTS = [[1, 40, 41, 42, 43], [MARK, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults"), max_position_embeddings=256)


def engine_kwargs():
    return dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)


class Fault:
    """Raises for the sequences of the marked request, at one stage."""

    def __init__(self, engine, stage: str, after_tokens: int = 0):
        self.engine, self.stage, self.after = engine, stage, after_tokens
        self.fired = 0

    def _marked(self, seq_id: int) -> bool:
        entry = self.engine.scheduler._seqs.get(seq_id)
        return entry is not None and entry[0].prompt_token_ids[0] == MARK \
            and entry[1].num_output_tokens >= self.after

    def __call__(self, stage: str, seq) -> None:
        seq_id = seq if stage == "sample" else seq.seq_id
        if stage == self.stage and self._marked(seq_id):
            self.fired += 1
            raise OverflowError("injected fault")


def reference(model, params):
    llm = LLM(model, **engine_kwargs())
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("stage,after", [("prepare", 0), ("prepare", 3), ("sample", 0),
                                         ("sample", 4)])
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async-scheduling"])
def test_one_request_fails_the_others_are_untouched(model, stage, after, ahead):
    # (n = 2 steps synchronously even under --async-scheduling; n = 1 runs ahead)
    params = SamplingParams(n=1 if ahead else 2, temperature=0.8, seed=7, max_tokens=8,
                            ignore_eos=True)
    expected = reference(model, params)
    llm = LLM(model, **engine_kwargs(), async_scheduling=ahead)
    fault = Fault(llm.engine, stage, after)
    llm.engine.executor.runner.fault_hook = fault
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert fault.fired >= 1
    failed = outs[1]
    assert failed.finished and "injected fault" in failed.error
    assert {c.finish_reason for c in failed.outputs} == {"error"}
    for i in (0, 2):
        assert outs[i].error is None
        assert [c.token_ids for c in outs[i].outputs] == expected[i]
    assert llm.engine.scheduler.kv.num_free_blocks == 64
    # The engine goes on: the same request without the fault now succeeds.
    llm.engine.executor.runner.fault_hook = None
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    assert again.error is None and [c.token_ids for c in again.outputs] == expected[1]


def test_prompt_logprobs_and_greedy_rows_fail_alone(model):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2)
    expected = reference(model, params)
    llm = LLM(model, **engine_kwargs())
    llm.engine.executor.runner.fault_hook = Fault(llm.engine, "sample")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert [[c.token_ids for c in o.outputs] for o in (outs[0], outs[2])] == \
        [expected[0], expected[2]]
    assert llm.engine.scheduler.kv.num_free_blocks == 64


def test_async_engine_raises_for_that_request_and_keeps_serving(model):
    engine = LLMEngine.from_args(model, **engine_kwargs())
    engine.executor.runner.fault_hook = Fault(engine, "prepare")
    async_engine = AsyncLLMEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(i):
        last = None
        async for last in async_engine.generate(f"r{i}", None, PROMPTS[i], params):
            pass
        return last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)), return_exceptions=True)

    try:
        results = asyncio.run(main())
        assert isinstance(results[1], RequestFailedError), results[1]
        assert "injected fault" in str(results[1])
        assert all(len(results[i].outputs[0].token_ids) == 6 for i in (0, 2))
        assert not async_engine.is_dead
        engine.executor.runner.fault_hook = None
        assert len(asyncio.run(one(1)).outputs[0].token_ids) == 6
        assert engine.scheduler.kv.num_free_blocks == 64
    finally:
        async_engine.shutdown()


def test_a_fault_of_the_forward_still_stops_the_engine(model):
    """Only the per-sequence stages are contained: a failing forward is the
    engine's own fault, and the loop stops (the server then exits)."""
    engine = LLMEngine.from_args(model, **engine_kwargs())
    dead = []

    def broken(*_a, **_k):
        raise RuntimeError("the forward broke")

    engine.executor.runner.model.forward = broken
    async_engine = AsyncLLMEngine(engine, on_dead=dead.append)

    async def main():
        async for _ in async_engine.generate("r", None, PROMPTS[0],
                                             SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(Exception, match="the forward broke"):
        asyncio.run(main())
    async_engine.shutdown()
    assert async_engine.is_dead and len(dead) == 1
    assert engine.scheduler.kv.num_free_blocks == 64
