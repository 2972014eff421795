"""Preemption changes no answer: a pool far too small against a roomy one."""

import random

from folio import LLM, SamplingParams
from tests.utils import make_tiny_model


def mixed_prompts(count: int, seed: int, low: int, high: int, vocab: int = 380):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(5, vocab) for _ in range(rng.randint(low, high))]}
            for _ in range(count)]


def test_hundred_requests_in_a_tiny_pool(tmp_path):
    path = make_tiny_model(tmp_path / "m", max_position_embeddings=512)
    prompts = mixed_prompts(100, 0, 4, 120)
    rng = random.Random(1)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 40), ignore_eos=True)
              for _ in prompts]
    roomy = LLM(path, dtype="float32", num_kv_blocks=4096, block_size=8)
    tight = LLM(path, dtype="float32", num_kv_blocks=40, block_size=8, max_num_seqs=16,
                max_num_batched_tokens=128)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.kv.num_free_blocks == 40


def test_seeded_samples_are_the_same_preempted_and_chunked_differently(tmp_path):
    """A sampled sequence's draws are a function of its seed and the position
    drawn for (model/layers/draws.py): recomputed after a preemption, its
    prompt chunked otherwise, in other batches, it draws the same tokens,
    penalties and n > 1 included."""
    path = make_tiny_model(tmp_path / "m", max_position_embeddings=512)
    prompts = mixed_prompts(40, 3, 4, 120)
    rng = random.Random(4)
    params = [SamplingParams(temperature=rng.choice([0.8, 1.2]), top_p=rng.choice([1.0, 0.9]),
                             seed=rng.randrange(1000), n=rng.choice([1, 1, 2]),
                             max_tokens=rng.randint(4, 40), ignore_eos=True,
                             **rng.choice([{}, {"frequency_penalty": 0.5,
                                                "repetition_penalty": 1.2}]))
              for _ in prompts]
    roomy = LLM(path, dtype="float32", num_kv_blocks=4096, block_size=8)
    tight = LLM(path, dtype="float32", num_kv_blocks=40, block_size=8, max_num_seqs=16,
                max_num_batched_tokens=64)

    def tokens(llm):
        return [[c.token_ids for c in o.outputs]
                for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens(tight) == tokens(roomy)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.kv.num_free_blocks == 40


def test_default_model_under_pressure(default_llm):
    prompts = mixed_prompts(14, 2, 40, 160, vocab=49000)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params,
                                                                      use_tqdm=False)]
    tight = LLM(dtype="float32", num_kv_blocks=24, max_num_batched_tokens=256, max_model_len=2048,
                activation_quantization="none")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.kv.num_free_blocks == 24


def test_priority_offline(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=1,
              scheduling_policy="priority")
    prompts = mixed_prompts(3, 3, 5, 10)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        priority=[5, 0, 1], use_tqdm=False)
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
