"""Pipeline parallelism (--pipeline-parallel-size) over gloo on the CPU: P=2 and
P=2 x T=2 give one rank's greedy tokens, alone and batched, under preemption
and with prefix caching; the default model's GGUF codes split the same way;
each stage builds and reads its own layers only; a rank that dies is
reported, not hung on; what cannot run with stages is refused by name."""

import pytest

from folio import LLM, SamplingParams
from folio.core.outputs import ScheduledSeq
from folio.model.loader import iter_weights, load_model_config
from folio.model.pipeline import StagePlan, stage_layers
from folio.worker.pipeline_stage import micro_batches
from tests.utils import make_tiny_model
from tests.worker.ranks import kill_a_worker_mid_run

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 5 layers: stages of 3 + 2 (P=2) and 2 + 2 + 1 (P=3)
    return make_tiny_model(tmp_path_factory.mktemp("pp"), num_hidden_layers=5)


def prompts():
    shared = [1, 7, 9, 11, 13, 17, 19, 23] * 3           # a prefix the prefix cache finds
    return [{"prompt_token_ids": shared + [20 + i, 30, 40, 50 + i] * (i + 1)}
            for i in range(6)]


def tokens(llm, batch, params=PARAMS):
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def run(path, batch, params=PARAMS, **engine) -> list:
    llm = LLM(path, dtype="float32", **engine)
    try:
        return tokens(llm, batch, params)
    finally:
        llm.shutdown()


def test_stages_split_the_layers_evenly_and_own_their_tensors():
    assert [list(stage_layers(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(stage_layers(30, r, 4)) for r in range(4)] == [8, 8, 7, 7]
    with pytest.raises(ValueError, match="5 decoder layers cannot be split into "
                                         "pipeline_parallel_size=6"):
        stage_layers(5, 0, 6)
    first, last = StagePlan(0, 2, range(0, 3)), StagePlan(1, 2, range(3, 5))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.layers.2.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight"]
    assert [n for n in names if first.owns(n)] == names[:2] + names[3:4]
    assert [n for n in names if last.owns(n)] == names[2:3] + names[4:]


def seqs(*lengths):
    return [ScheduledSeq(seq_id=i, token_ids=[0] * n, start_pos=0, new_block_ids=[])
            for i, n in enumerate(lengths)]


def test_micro_batches_are_contiguous_balanced_and_never_empty():
    def cut(lengths, count):
        return [[s.seq_id for s in run] for run in micro_batches(seqs(*lengths), count)]
    assert cut([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert cut([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert cut([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert cut([5], 3) == [[0]]
    assert cut([1, 1], 3) == [[0], [1]]
    assert cut([4, 4, 4, 4, 4, 4], 3) == [[0, 1], [2, 3], [4, 5]]


def test_p2_and_p2_by_t2_match_one_rank_alone_and_batched(tiny):
    expected = run(tiny, prompts(), num_kv_blocks=64)
    alone = run(tiny, prompts()[:1], num_kv_blocks=64)
    for pp, tp in ((2, 1), (2, 2), (3, 1)):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=64, pipeline_parallel_size=pp,
                  tensor_parallel_size=tp)
        try:
            assert tokens(llm, prompts()[:1]) == alone, (pp, tp)
            assert tokens(llm, prompts()) == expected, (pp, tp)
            sched = llm.engine.scheduler
            assert sched.prefix_cache_hits > 0        # the shared prefix found on every stage
            assert llm.engine.executor.runner.pipeline is not None
        finally:
            llm.shutdown()
        assert not any(w.is_alive() for w in llm.engine.executor.workers)


def test_p2_and_p2_by_t2_under_preemption_match_one_rank(tiny):
    """12 blocks of 8 tokens for 6 sequences that grow to ~7 blocks each:
    the scheduler preempts and recomputes, on every stage alike."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(num_kv_blocks=12, block_size=8, max_num_seqs=6)
    expected = run(tiny, prompts(), params, **engine)
    for tp in (1, 2):
        llm = LLM(tiny, dtype="float32", pipeline_parallel_size=2, tensor_parallel_size=tp,
                  **engine)
        try:
            assert tokens(llm, prompts(), params) == expected, tp
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.shutdown()


def test_samples_beams_and_prompt_logprobs_under_p2_match_one_rank(tiny):
    """n > 1 forks its samples from the prompt's last row on every stage;
    seeded samples, a beam search and prompt logprobs give one rank's answers."""
    from folio import BeamSearchParams
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    batch = prompts()[:2]

    scored = SamplingParams(max_tokens=1, prompt_logprobs=2)

    def answers(llm):
        outs = llm.generate(batch, sampled, use_tqdm=False)
        found = llm.beam_search([batch[0]], beams, use_tqdm=False)
        ranked = llm.generate(batch, scored, use_tqdm=False)     # rows of every micro-batch
        return ([[c.token_ids for c in o.outputs] for o in outs],
                [c.token_ids for c in found[0].outputs],
                [p for o in ranked for p in o.prompt_logprobs[1:]])
    one = LLM(tiny, dtype="float32", num_kv_blocks=64)
    samples, found, ranked = answers(one)
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2)
    try:
        got_samples, got_found, got_ranked = answers(llm)
    finally:
        llm.shutdown()
    assert got_samples == samples and got_found == found
    assert len(got_ranked) == len(ranked)
    for got, want in zip(got_ranked, ranked):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in want)


def test_each_stage_builds_and_reads_its_own_layers(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=16, pipeline_parallel_size=2)
    try:
        runner = llm.engine.executor.runner          # rank 0: stage 0
        names = {n for n, _ in runner.model.named_parameters()}
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == {0, 1, 2}
        assert any(n.startswith("model.embed_tokens.") for n in names)
        assert not any(n.startswith("model.norm.") for n in names)
        assert len(runner.kv_caches) == 3                 # its layers' caches only
    finally:
        llm.shutdown()
    config = load_model_config(tiny)
    read = [n for n, _ in iter_weights(config, keep=StagePlan(1, 2, range(3, 5)).owns)]
    assert read and all(n.startswith(("model.layers.3.", "model.layers.4.", "model.norm."))
                        for n in read)


def test_the_default_models_codes_split_in_two_stages(default_llm):
    chats = [{"prompt_token_ids": default_llm.get_tokenizer().encode_chat(
        [{"role": "user", "content": q}])} for q in ["Hi!", "What is 2+2?", "Name a fruit."]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = tokens(default_llm, chats, params)
    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=2048,
              activation_quantization="none", pipeline_parallel_size=2)
    try:
        # stage 0's 15 layers in one native call (the one-call decoder per stage)
        assert llm.engine.executor.runner.model.model.native_decoder is not None
        assert tokens(llm, chats, params) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["gptq-w4-g32-descact", "awq-w4-g32", "ct-w8a16-channel"])
def test_quantized_checkpoints_split_in_two_stages(name):
    """Checkpoints made by real tools (tests/fixtures/quant), in their codes."""
    from pathlib import Path
    path = str(Path(__file__).resolve().parents[1] / "fixtures" / "quant" / name)
    batch = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50 + i] * (i + 1)} for i in range(3)]
    expected = run(path, batch, num_kv_blocks=32)
    assert run(path, batch, num_kv_blocks=32, pipeline_parallel_size=2) == expected


def test_a_dead_stage_is_reported_not_hung_on(tiny):
    kill_a_worker_mid_run(LLM(tiny, dtype="float32", num_kv_blocks=64,
                              pipeline_parallel_size=2))


def test_what_stages_cannot_run_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="5 decoder layers cannot be split into "
                                         "pipeline_parallel_size=6"):
        LLM(tiny, dtype="float32", num_kv_blocks=16, pipeline_parallel_size=6)
    with pytest.raises(ValueError, match="speculative decoding with pipeline parallelism"):
        LLM(tiny, dtype="float32", num_kv_blocks=16, pipeline_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA adapters with pipeline parallelism"):
        LLM(tiny, dtype="float32", num_kv_blocks=16, pipeline_parallel_size=2,
            enable_lora=True)
