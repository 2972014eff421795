"""Qwen3 (dense) beyond test_parity_tiny.py's greedy cases: its config read as
it is (a head_dim of its own, no q/k/v bias, per-head q/k norms loaded); and
for Qwen3 and Phi-3 (tests/engine/test_phi3.py has its own) a prefix-cache
hit, tensor parallelism 2 and prompt logprobs, each against transformers on
the same tiny random checkpoint (saved by transformers)."""

import random

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model.loader import load_model_config
from tests.parity import (assert_prefix_hit_parity, assert_tp2_greedy_parity, prompt_logprobs,
                          reference_prompt_logprobs)
from tests.utils import load_reference_model, make_tiny_model

NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", dialect="v5",
                           head_dim=32)
    return path, load_reference_model(path)


@pytest.fixture(scope="module", params=["qwen3", "phi3"])
def dense(request, tmp_path_factory):
    extra = {"head_dim": 32} if request.param == "qwen3" else {}
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param,
                           dialect="v5", **extra)
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


def test_a_prefix_hit_gives_transformers_tokens(dense):
    path, ref_model = dense
    assert_prefix_hit_parity(path, ref_model, NEW)


def test_tensor_parallel_2_gives_transformers_tokens(dense):
    path, ref_model = dense
    assert_tp2_greedy_parity(path, ref_model, _prompts(3, 5), NEW)


def test_prompt_logprobs_match_transformers(dense):
    path, ref_model = dense
    [ids] = _prompts(1, 9)
    got = prompt_logprobs(LLM(path, dtype="float32", num_kv_blocks=32), ids)
    assert torch.allclose(got, reference_prompt_logprobs(ref_model, ids), atol=1e-4)
