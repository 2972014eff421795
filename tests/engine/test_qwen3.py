"""Qwen3 (dense) beyond test_parity_tiny.py's greedy cases: its config read as
it is (a head_dim of its own, no q/k/v bias, per-head q/k norms loaded), a
prefix-cache hit, tensor parallelism 2 and prompt logprobs, each against
transformers on the same tiny random checkpoint (saved by transformers)."""

import random

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model.loader import load_model_config
from tests.parity import assert_greedy_parity, reference_greedy
from tests.utils import load_reference_model, make_tiny_model

NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", dialect="v5",
                           head_dim=32)
    return path, load_reference_model(path)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 384) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def test_the_config_and_weights_are_qwen3s(qwen3):
    path, _ = qwen3
    cfg = load_model_config(path)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.head_dim == 32 and cfg.hidden_size // cfg.num_attention_heads == 16
    assert not cfg.attention_bias
    llm = LLM(path, dtype="float32", num_kv_blocks=32)
    attn = llm.engine.executor.runner.model.model.layers[1].self_attn
    assert attn.qkv_proj.bias is None
    ref = load_reference_model(path).model.layers[1].self_attn
    assert torch.equal(attn.q_norm.weight, ref.q_norm.weight)
    assert torch.equal(attn.k_norm.weight, ref.k_norm.weight)
    # the norms are not all ones (a norm skipped in forward would go unseen)
    assert not torch.equal(ref.k_norm.weight, torch.ones_like(ref.k_norm.weight))


def test_a_prefix_hit_gives_transformers_tokens(qwen3):
    path, ref_model = qwen3
    shared = [random.Random(3).randrange(5, 384) for _ in range(48)]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8)
    llm.generate({"prompt_token_ids": first}, PARAMS)
    out = llm.generate({"prompt_token_ids": second}, PARAMS)[0]
    assert out.num_cached_tokens == 48
    ref, gaps = reference_greedy(ref_model, second, NEW, ())
    assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label="prefix hit")


def test_tensor_parallel_2_gives_transformers_tokens(qwen3):
    path, ref_model = qwen3
    batch = _prompts(3, 5)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    for ids, out in zip(batch, outs):
        ref, gaps = reference_greedy(ref_model, ids, NEW, ())
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=f"tp2 {len(ids)}")


@torch.inference_mode()
def test_prompt_logprobs_match_transformers(qwen3):
    path, ref_model = qwen3
    [ids] = _prompts(1, 9)
    llm = LLM(path, dtype="float32", num_kv_blocks=32)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = [next(iter(entry.values())) if entry else None for entry in out.prompt_logprobs]
    logits = ref_model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert got[0] is None
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-4)
