"""--async-scheduling: step N + 1 scheduled while step N runs on the runner's
thread. The same tokens as synchronous steps, every block back, and the
requests that must wait for their tokens (n > 1, beams, structured outputs,
min_tokens) stepping synchronously beside the others; penalized ones run
ahead, their counts taking the step before's token on the device."""

import pytest

from folio import LLM, SamplingParams
from folio.core.beam import BeamSearchParams
from folio.structured_outputs import StructuredOutputsParams
from tests.utils import TINY_EOS_ID, make_tiny_model

PROMPTS = ["Hello world", "The quick brown fox", "Paged attention keeps", "café naïve",
           "def f(x):", "Continuous batching admits"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ahead"))


@pytest.fixture(scope="module")
def pair(model):
    sync = LLM(model, dtype="float32", num_kv_blocks=64)
    ahead = LLM(model, dtype="float32", num_kv_blocks=64, async_scheduling=True)
    yield sync, ahead
    ahead.shutdown()


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for p, q in zip(x.outputs, y.outputs, strict=True):
            assert (p.token_ids, p.text, p.finish_reason, p.stop_reason) == \
                (q.token_ids, q.text, q.finish_reason, q.stop_reason)
            assert p.cumulative_logprob == pytest.approx(q.cumulative_logprob, abs=1e-5)
            assert (p.logprobs is None) == (q.logprobs is None)
            for x, y in zip(p.logprobs or (), q.logprobs or (), strict=True):
                assert x.keys() == y.keys()
                assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)


def _whole(llm):
    engine = llm.engine
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
    assert all(not s.placeholders for r in engine.scheduler.requests.values() for s in r.seqs)


@pytest.mark.parametrize("params", [
    dict(temperature=0, max_tokens=20, ignore_eos=True),
    dict(temperature=0, max_tokens=1, ignore_eos=True),          # no step reads a placeholder
    dict(temperature=0, max_tokens=2, ignore_eos=True),
    dict(temperature=0, max_tokens=64),                          # ends at EOS mid-flight
    dict(temperature=0.8, seed=3, max_tokens=24),                # seeded: the same draws
    dict(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[7, 9, 11]),
    dict(temperature=0, max_tokens=24, ignore_eos=True, stop=["e", " t"]),   # text stops
    dict(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3,
         repetition_penalty=1.3, min_tokens=5),      # min_tokens: synchronous steps
    dict(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
         frequency_penalty=0.5, presence_penalty=0.3),   # penalties: ahead, counted on device
    dict(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, frequency_penalty=1.0),
    dict(temperature=0.7, seed=11, max_tokens=24, ignore_eos=True, logprobs=3),
])
def test_the_same_tokens_as_synchronous_steps(pair, params):
    sync, ahead = pair
    sp = SamplingParams(**params)
    _same(ahead.generate(PROMPTS, sp), sync.generate(PROMPTS, sp))
    _whole(ahead)


def test_a_token_past_a_stop_is_never_emitted(pair):
    """The step after an EOS already ran for that request: its token is dropped."""
    sync, ahead = pair
    sp = SamplingParams(temperature=0, max_tokens=64)
    outs = ahead.generate(PROMPTS, sp)
    assert any(o.outputs[0].token_ids[-1] == TINY_EOS_ID for o in outs)
    for o in outs:
        ids = o.outputs[0].token_ids
        assert TINY_EOS_ID not in ids[:-1] and -1 not in ids
    _same(outs, sync.generate(PROMPTS, sp))


def test_under_preemption_and_with_prefix_hits(model):
    """A cache too small for all at once: requests are preempted with a step in
    flight and recomputed; shared prompts hit the prefix cache."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p + " and so on, and so on, and so on" for p in PROMPTS] * 2
    for blocks in (24, 14):     # 14: no request fits whole, each ends when it cannot grow
        sync = LLM(model, dtype="float32", num_kv_blocks=blocks, block_size=4)
        ahead = LLM(model, dtype="float32", num_kv_blocks=blocks, block_size=4,
                    async_scheduling=True)
        try:
            expect = sync.generate(prompts, sp)
            got = ahead.generate(prompts, sp)
            if blocks == 24:
                assert ahead.engine.scheduler.num_preemptions > 0
                assert ahead.engine.scheduler.prefix_cache_hits > 0
            else:
                assert all(len(o.outputs[0].token_ids) < 40 for o in got)
            _same(got, expect)
            _whole(ahead)
        finally:
            ahead.shutdown()


def test_requests_that_need_their_tokens_step_synchronously_beside_the_others(pair):
    sync, ahead = pair
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    forked = SamplingParams(temperature=0.9, seed=1, n=3, max_tokens=16, ignore_eos=True)
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=
                            StructuredOutputsParams(choice=["yes", "no"]))
    params = [greedy, forked, greedy, choice]
    _same(ahead.generate(PROMPTS[:4], params), sync.generate(PROMPTS[:4], params))
    beams = BeamSearchParams(beam_width=2, max_tokens=8)
    a = ahead.beam_search(PROMPTS[:2], beams)
    b = sync.beam_search(PROMPTS[:2], beams)
    assert [[s.token_ids for s in o.outputs] for o in a] == \
        [[s.token_ids for s in o.outputs] for o in b]
    _same(ahead.generate(PROMPTS, greedy), sync.generate(PROMPTS, greedy))   # ahead again
    _whole(ahead)


def test_an_abort_with_a_step_in_flight_frees_every_block(pair):
    _, ahead = pair
    engine = ahead.engine
    ids = engine.input_processor.tokenize("Hello world")[1]
    for i in range(3):
        engine.add_tokenized_request(f"a{i}", None, ids, SamplingParams(
            temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    # the step handed over keeps its samples as tensors until it is taken in,
    # and the runner keeps them for the next step's placeholders
    so, handle = engine._in_flight
    assert handle._out.pending and not handle._out.token_ids
    runner = engine.executor.runner
    assert set(runner.ahead.rows) == {s.seq_id for s in so.seqs}
    engine.abort_request(["a0", "a1", "a2"])
    while engine.has_unfinished_requests():
        assert all(o.request_id not in ("a0", "a1", "a2") for o in engine.step())
    _whole(ahead)


def test_speculative_decoding_and_tensor_parallelism_never_run_ahead(model, pair):
    """Both take the flag and step synchronously: the same tokens as without it."""
    sync, _ = pair
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expect = sync.generate(PROMPTS, sp)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}
    for kwargs in (dict(speculative_config=ngram), dict(tensor_parallel_size=2)):
        llm = LLM(model, dtype="float32", num_kv_blocks=64, async_scheduling=True, **kwargs)
        try:
            assert not llm.engine.scheduler.ahead
            _same(llm.generate(PROMPTS, sp), expect)
            _whole(llm)
        finally:
            llm.shutdown()


def test_a_mixed_lora_batch_runs_ahead_with_each_adapter_s_tokens(tmp_path):
    from folio.lora_request import LoRARequest
    from tests.utils import make_lora_adapter
    base = make_tiny_model(tmp_path / "base")
    path, _ = make_lora_adapter(base, tmp_path / "qv", seed=1, r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj"])
    lora = LoRARequest("qv", 1, path)
    loras = [None, lora] * 3
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = []
    for ahead in (False, True):
        llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True,
                  async_scheduling=ahead)
        got.append(llm.generate(PROMPTS, sp, lora_request=loras))
        assert llm.engine.scheduler.ahead == ahead
        _whole(llm)
        if not ahead:          # the adapter does change its requests' tokens
            plain = llm.generate(PROMPTS, sp)
            assert any(a.outputs[0].token_ids != b.outputs[0].token_ids
                       for a, b in zip(plain[1::2], got[0][1::2]))
        llm.shutdown()
    _same(got[1], got[0])


def test_penalized_requests_run_ahead_and_count_the_token_on_the_device(pair, monkeypatch):
    sync, ahead = pair
    penalties = ahead.engine.executor.runner.columns.penalties
    counted = []
    real = penalties.add_on_device

    def spy(rows, tokens, num_rows):
        counted.append(len(rows))
        return real(rows, tokens, num_rows)
    monkeypatch.setattr(penalties, "add_on_device", spy)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0,
                        presence_penalty=1.5)
    _same(ahead.generate(PROMPTS, sp), sync.generate(PROMPTS, sp))
    # every decode after the first read its input from the device, all rows at once
    assert len(counted) >= 14 and max(counted) == len(PROMPTS)
    _whole(ahead)
