"""The offline LLM with its engine core in a process of its own
(`LLM(engine_process=True)`): the same answers as the engine in the caller's
thread (greedy with logprobs, seeded n > 1, stop strings, beams, preemption
under a small cache), a refused request a ValueError that leaves the rest
usable, and the core's process gone after shutdown."""

import pytest

from folio import LLM, BeamSearchParams, SamplingParams
from tests.utils import make_tiny_model

ARGS = dict(dtype="float32", num_kv_blocks=14, block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("core"), max_position_embeddings=128)
    inproc, core = LLM(path, **ARGS), LLM(path, engine_process=True, **ARGS)
    yield inproc, core
    core.shutdown()


PROMPTS = ["Hello world", {"prompt_token_ids": [1, 50, 60, 70]}, "The quick brown fox",
           "Paged attention"]


def _same(a, b):
    """The same tokens, text, ends and logprob ids; the logprobs to fp32 rounding
    (a float32 product can round its last bit apart from one process to another
    with its operands' alignment: seen once in a long run, 2026-12-07)."""
    assert [o.prompt_token_ids for o in a] == [o.prompt_token_ids for o in b]
    for x, y in zip(a, b):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
                for c in x.outputs] == [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
                                        for c in y.outputs]
        for c, d in zip(x.outputs, y.outputs):
            assert (c.logprobs is None) == (d.logprobs is None)
            for p, q in zip(c.logprobs or [], d.logprobs or []):
                assert p.keys() == q.keys()
                assert all(p[k] == pytest.approx(q[k], abs=1e-5) for k in p)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30, stop=["e"]),
], ids=["greedy-logprobs", "seeded-n2", "stop-string"])
def test_the_core_process_answers_as_the_engine_thread(pair, params):
    inproc, core = pair
    # 4 prompts of 4-9 tokens and their answers in 14 blocks of 4: they are
    # preempted and recomputed (the core's count reaches this side's outputs)
    got = core.generate(PROMPTS, params, use_tqdm=False)
    _same(got, inproc.generate(PROMPTS, params, use_tqdm=False))
    assert any(o.num_preemptions for o in got)


def test_beams_and_a_cache_reset_through_the_core(pair):
    inproc, core = pair
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    got, want = core.beam_search(PROMPTS[:2], params), inproc.beam_search(PROMPTS[:2], params)
    for x, y in zip(got, want):
        assert [(c.token_ids, c.text) for c in x.outputs] == \
            [(c.token_ids, c.text) for c in y.outputs]
        assert [c.score for c in x.outputs] == pytest.approx([c.score for c in y.outputs])
    assert core.reset_prefix_cache() is True        # nothing holds blocks now


def test_a_request_the_core_refuses_fails_alone(pair):
    """Too long for the whole cache (14 blocks of 4 tokens; 56 prompt and 8
    output tokens need 16): the core refuses it, generate raises its
    ValueError, and the next call is answered as before, no block left held."""
    inproc, core = pair
    too_long = {"prompt_token_ids": list(range(3, 59))}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError) as refused:
        core.generate([PROMPTS[0], too_long], params, use_tqdm=False)
    with pytest.raises(ValueError) as want:
        inproc.generate([PROMPTS[0], too_long], params, use_tqdm=False)
    assert str(refused.value) == str(want.value)
    assert not core.engine.has_unfinished_requests()
    _same(core.generate(PROMPTS, params, use_tqdm=False),
          inproc.generate(PROMPTS, params, use_tqdm=False))
    assert core.reset_prefix_cache() is True        # every block back


def test_a_batch_reaches_the_core_as_one_message(pair, monkeypatch):
    """generate's prompts cross the pipe as one "adds" message, before the
    client first waits for a step: the core's first step sees the whole batch,
    as the in-process engine's does, however late the core's process runs
    (sent one by one, a loaded machine let the core step on the first alone:
    other batches, other float products; tests/engine/test_embed.py's
    own-process test failed that way)."""
    _, core = pair
    client = core.engine
    sent = []
    send = client._conn.send
    monkeypatch.setattr(client._conn, "send", lambda msg: (sent.append(msg), send(msg))[1])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = core.generate(PROMPTS, params, use_tqdm=False)
    adds = [m for m in sent if m[0] in ("add", "adds")]
    assert [m[0] for m in adds] == ["adds"] and len(adds[0][1]) == len(PROMPTS)
    assert [a[1] for a in adds[0][1]] == [o.prompt_token_ids for o in got]
    assert sent[0][0] == "adds"      # before anything else: the client's first wait flushes it


def test_shutdown_ends_the_core_process(tmp_path):
    path = make_tiny_model(tmp_path, max_position_embeddings=128)
    llm = LLM(path, engine_process=True, **ARGS)
    proc = llm.engine._core.proc
    assert proc.is_alive()
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    llm.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0
