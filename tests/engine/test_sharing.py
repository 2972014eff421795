"""KV sharing on a tiny model: copy-on-write n > 1 and automatic prefix caching."""

import pytest

from folio import LLM, SamplingParams
from folio.core.kv_cache_manager import cdiv
from tests.utils import make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("share"), max_position_embeddings=1024)


def run_tracking_peak(llm, requests) -> tuple[list, int]:
    """Drive the engine; returns (finished outputs in order, peak blocks held)."""
    engine, peak, done = llm.engine, 0, {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak = max(peak, engine.scheduler.kv.pool.num_used_blocks)
    return [done[rid] for rid, _, _ in requests], peak


def test_n4_shares_the_prompt_and_each_sample_is_its_own(path):
    prompt = {"prompt_token_ids": [1] + [(i * 11) % 380 + 3 for i in range(49)]}   # 50 tokens
    gen = 8
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=gen, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=BLOCK)
    (out,), peak = run_tracking_peak(llm, [("n4", prompt, params)])
    prompt_blocks = cdiv(50, BLOCK)
    assert peak <= prompt_blocks + 4 * (cdiv(gen, BLOCK) + 1)
    # Four separate requests without prefix caching hold four prompts' worth.
    alone = LLM(path, dtype="float32", num_kv_blocks=128, block_size=BLOCK,
                enable_prefix_caching=False)
    singles = [(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=42 + i, max_tokens=gen,
                                                 ignore_eos=True)) for i in range(4)]
    outs, separate_peak = run_tracking_peak(alone, singles)
    assert separate_peak >= 4 * prompt_blocks > peak
    # Copy-on-write never lets one sample see another's tokens: the i-th sample
    # equals the same seeded sample run alone.
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_greedy_samples_agree_and_blocks_return(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BLOCK)
    out = llm.generate({"prompt_token_ids": [1, 5, 6, 7, 8, 9]},
                       SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert [c.index for c in out.outputs] == [0, 1, 2]


def test_prefix_cache_computes_only_new_tokens_and_changes_nothing(path):
    shared = [1] + [(i * 7) % 380 + 3 for i in range(511)]            # a 512-token prefix
    first = {"prompt_token_ids": shared + [10, 11, 12]}
    second = {"prompt_token_ids": shared + [20, 21, 22, 23, 24]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached = LLM(path, dtype="float32", num_kv_blocks=512, block_size=16)
    plain = LLM(path, dtype="float32", num_kv_blocks=512, block_size=16,
                enable_prefix_caching=False)
    runner = cached.engine.executor.runner
    cached.generate(first, params)
    before = runner.num_computed_tokens_total
    hit = cached.generate(second, params)[0]
    # 512 cached tokens; the model ran the 5 new prompt tokens and 5 decode steps.
    assert hit.num_cached_tokens == 512
    assert runner.num_computed_tokens_total - before == 5 + 5
    assert hit.outputs[0].token_ids == plain.generate(second, params)[0].outputs[0].token_ids
    # A full hit still computes the last prompt token (its logits are needed).
    again = cached.generate(second, params)[0]
    assert again.num_cached_tokens == 512 and again.outputs[0].token_ids == hit.outputs[0].token_ids
    assert cached.engine.scheduler.prefix_cache_hits >= 1024


def test_prompt_logprobs_bypass_the_cache(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BLOCK)
    prompt = {"prompt_token_ids": [1] + list(range(30, 50))}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 21


def test_eviction_under_pressure_spares_running_requests(path):
    """A pool that cannot keep every finished prompt cached: later requests evict
    old cached blocks, never blocks a running request holds, and outputs match a
    roomy run."""
    prompts = [{"prompt_token_ids": [1] + [(i * 5 + k) % 380 + 3 for i in range(40)]}
               for k in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tight = LLM(path, dtype="float32", num_kv_blocks=30, block_size=BLOCK, max_num_seqs=2)
    roomy = LLM(path, dtype="float32", num_kv_blocks=512, block_size=BLOCK)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts + prompts[:2], params)]
    assert got[:8] == expected and got[8:] == expected[:2]
