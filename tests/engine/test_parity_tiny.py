"""Greedy parity with transformers on tiny random HF folders: Llama-, Qwen2-,
Qwen3-, Mistral-, Mixtral-, Qwen3-MoE- and Gemma 3-style, both config dialects, tied and
untied embeddings, Llama-3 rope scaling, sharded checkpoints; one at a time and
in one continuous batch under a small token budget and KV pool (chunked
prefill and preemption on the way)."""

import random
import zlib

import pytest

from folio import LLM, SamplingParams
from tests.parity import assert_greedy_parity, reference_greedy
from tests.utils import load_reference_model, make_tiny_model

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CASES = {
    "llama-classic": dict(arch="llama", dialect="classic"),
    "llama-v5-tied-sharded": dict(arch="llama", dialect="v5", tie_word_embeddings=True, num_shards=3),
    "llama3-rope": dict(arch="llama", dialect="classic", rope_scaling=LLAMA3_SCALING),
    "qwen2-v5": dict(arch="qwen2", dialect="v5"),
    "qwen2-classic-tied": dict(arch="qwen2", dialect="classic", tie_word_embeddings=True),
    "mistral-v5": dict(arch="mistral", dialect="v5"),
    # per-head q/k norms, and a head_dim (32) that is not hidden / heads (16)
    "qwen3-v5": dict(arch="qwen3", dialect="v5", head_dim=32),
    "qwen3-classic-tied": dict(arch="qwen3", dialect="classic", tie_word_embeddings=True),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint (tests/engine/test_phi3.py)
    "phi3-v5": dict(arch="phi3", dialect="v5"),
    # mixture of experts (tests/engine/test_moe.py has more): top-2 of 4 / of 8 experts
    "mixtral-v5": dict(arch="mixtral", dialect="v5", num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=48),
    "qwen3moe-classic": dict(arch="qwen3_moe", dialect="classic", num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True),
    # Gemma 3: a 16-token window on two local layers, one global (prompts run past it)
    "gemma3-v5": dict(arch="gemma3", dialect="v5"),
    "gemma3-classic-tied-rope": dict(arch="gemma3", dialect="classic", tie_word_embeddings=True,
                                     rope_scaling={"rope_type": "linear", "factor": 4.0}),
}
NEW_TOKENS = 20


def prompts(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2] + [rng.randint(30, 90) for _ in range(count - 2)]
    return [[rng.randrange(5, 384) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    ref_model = load_reference_model(path)
    batch = prompts(zlib.crc32(request.param.encode()))
    refs = [reference_greedy(ref_model, ids, NEW_TOKENS, ()) for ids in batch]
    return path, batch, refs


def test_one_at_a_time(case):
    path, batch, refs = case
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for ids, (ref, gaps) in zip(batch, refs):
        out = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
        assert_greedy_parity(out.token_ids, ref, gaps, label=f"prompt of {len(ids)}")


def test_batched_under_pressure(case):
    """Block size 4, a pool that cannot hold every sequence, a 32-token budget."""
    path, batch, refs = case
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    for out, (ref, gaps) in zip(outs, refs):
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=out.request_id)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0"),
                                        ("llama", "F16"), ("qwen3", "Q8_0")])
def test_gguf_parity(tmp_path, arch, qtype):
    """A tiny model converted to GGUF as llama.cpp does (q/k rows permuted, matrices
    quantized) runs token for token as transformers' own GGUF load of it."""
    from tests.utils import write_tiny_gguf
    folder = make_tiny_model(tmp_path / "hf", arch=arch, dialect="v5")
    path = write_tiny_gguf(folder, tmp_path / f"tiny-{qtype}.gguf", qtype)
    ref_model = load_reference_model(path)
    # fp32 arithmetic on the codes: the path held to transformers token for token
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8,
              activation_quantization="none")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = prompts(7, count=4)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outs):
        ref, gaps = reference_greedy(ref_model, ids, NEW_TOKENS, ())
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=f"{arch} {qtype}")
