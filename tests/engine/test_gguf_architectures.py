"""GGUFs of the newer architectures: Qwen3-MoE (`qwen3moe`), Mixtral (a `llama`
file with an expert count), Gemma 3 (`gemma3`) and Phi-3 (`phi3`), written from tiny random
transformers checkpoints as llama.cpp's converter writes them (tests/utils.py's
write_tiny_gguf: experts stacked into ffn_*_exps and the router as
ffn_gate_inp; Gemma's norms as 1 + w, its window and local rope base in the
metadata). Folio answers as transformers does on the Hugging Face folder,
alone and batched (Gemma's prompts longer than its window), and as llama.cpp's
own llama-server does on the same file (where one is built). llama.cpp
renormalizes both MoE families' top-k weights (the file does not say
norm_topk_prob), so the checkpoints do too; it scales Gemma's queries by
1/sqrt(head_dim) (the file does not say query_pre_attn_scalar), so the
checkpoint does too."""

import pytest
import torch

from folio import LLM, SamplingParams
from tests.engine.test_moe import MODELS as MOE_MODELS
from tests.parity import (assert_greedy_parity, prompt_logprobs, reference_greedy,
                          reference_prompt_logprobs)
from tests.utils import (GEMMA3_TINY, TINY_EOS_ID, TINY_IM_END_ID, load_reference_model,
                         make_tiny_model, write_tiny_gguf)

NEW = 12
LLAMA_CPP_TIE_GAP = 1e-2        # top-2 gaps its float16 KV cache may flip
# test_moe.py's checkpoints, Qwen3-MoE's top-k renormalized (as llama.cpp runs it);
# its dense layer (mlp_only_layers) between MoE ones is a layer with no router
MODELS = {"mixtral": MOE_MODELS["mixtral"],
          "qwen3_moe": {**MOE_MODELS["qwen3_moe"], "norm_topk_prob": True},
          "gemma3": dict(arch="gemma3", query_pre_attn_scalar=GEMMA3_TINY["head_dim"]),
          # fused attn_qkv and ffn_up (gate then up), as Phi-3's checkpoints hold them
          "phi3": dict(arch="phi3", dialect="v5")}


@pytest.fixture(scope="module", params=list(MODELS))
def moe_gguf(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(root / "hf", **MODELS[request.param])
    return request.param, write_tiny_gguf(folder, root / "model.gguf"), \
        load_reference_model(folder)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Lengths 3 to 40: past Gemma's window of 16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (int(torch.randint(3, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def test_the_config_is_the_checkpoints(moe_gguf):
    name, path, ref = moe_gguf
    cfg = LLM(path, dtype="float32", num_kv_blocks=16).engine.config.model
    hf = ref.config
    if name == "phi3":
        assert (cfg.architecture, cfg.num_experts) == ("Phi3ForCausalLM", 0)
        return
    if name == "gemma3":
        assert (cfg.architecture, cfg.layer_types, cfg.sliding_window) == (
            "Gemma3ForCausalLM", tuple(hf.layer_types), hf.sliding_window)
        assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (
            hf.rope_parameters["sliding_attention"]["rope_theta"], hf.query_pre_attn_scalar)
        return
    experts = getattr(hf, "num_local_experts", None) or hf.num_experts
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (
        type(ref).__name__, experts, hf.num_experts_per_tok)
    assert cfg.moe_intermediate_size == getattr(hf, "moe_intermediate_size",
                                                hf.intermediate_size)
    assert cfg.mlp_only_layers == tuple(getattr(hf, "mlp_only_layers", ()))
    assert cfg.norm_topk_prob


def test_greedy_tokens_alone_and_batched_and_logprobs_are_transformers(moe_gguf):
    name, path, ref = moe_gguf
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (p, out) in enumerate(zip(prompts, batched)):
        tokens, gaps = reference_greedy(ref, p, NEW, [])
        assert_greedy_parity(list(out.outputs[0].token_ids), tokens, gaps, f"{name} {i}")
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert alone.outputs[0].token_ids == batched[0].outputs[0].token_ids
    ids = prompts[1]
    assert torch.allclose(prompt_logprobs(llm, ids), reference_prompt_logprobs(ref, ids),
                          atol=2e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_quantized_file_keeps_its_weights_and_experts_in_codes(moe_gguf, tmp_path, qtype):
    """Q8_0 (or Q4_1) throughout: the attention's and dense layers' weights and
    (MoE) every expert's two matrices stay packed, no float expert held (the
    router arrives dequantized, F32 as llama.cpp writes it); the tokens and
    logprobs are those of the same file read all dequantized (`-q none`: the
    gguf package's values), whose MoE the F32 tests above check against
    transformers. (transformers' own GGUF reader does not read these files'
    experts.)"""
    from folio.model.layers.moe import ExpertMatrix, FusedMoE
    from folio.model.layers.quantization.int_groups import IntGroupsLinear
    name, _, _ = moe_gguf
    if qtype == "Q4_1" and name not in ("mixtral", "qwen3_moe"):
        pytest.skip("the 4-bit codes of the dense models are tested in test_gguf.py")
    sizes = {"intermediate_size": 64} if name == "mixtral" else \
        {"head_dim": 32, "query_pre_attn_scalar": 32} if name == "gemma3" else {}  # whole blocks
    folder = make_tiny_model(tmp_path / "hf", **{**MODELS[name], **sizes})
    path = write_tiny_gguf(folder, tmp_path / "q.gguf", qtype)
    packed = LLM(path, dtype="float32", num_kv_blocks=32, activation_quantization="none")
    model = packed.engine.executor.runner.model
    assert isinstance(model.model.layers[0].self_attn.o_proj.quant_method, IntGroupsLinear)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert bool(moes) == (name in ("mixtral", "qwen3_moe"))
    for moe in moes:
        experts = [m for pair in moe.packed_experts for m in pair]
        assert len(experts) == 2 * moe.num_experts
        assert all(isinstance(m, ExpertMatrix) and m.weights.bits == int(qtype[1])
                   for m in experts)
        assert all(p.numel() == 0 for n, p in moe.named_parameters() if not n.startswith("gate"))
    floats = LLM(path, dtype="float32", num_kv_blocks=32, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for prompt in _prompts(3, seed=9):
        a, b = (llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
                for llm in (packed, floats))
        assert a == b
        assert torch.allclose(prompt_logprobs(packed, prompt), prompt_logprobs(floats, prompt),
                              atol=2e-4)


def test_llama_cpp_gives_the_same_tokens_on_the_same_file(tmp_path):
    """llama.cpp's graph on the file (F32 weights: fp32 products, no activation
    quantization; its KV cache float16), against Folio's: the same greedy tokens
    but where a top-2 gap under 1e-2 makes it a near-tie. llama.cpp's
    qwen3moe has a router in every layer, so this checkpoint has no dense one."""
    from folio.bench.llama_cpp import LlamaServer, _post, find_llama_server
    try:
        exe = find_llama_server()
    except ValueError as e:
        pytest.skip(f"no llama-server on this machine ({e})")
    for name, kwargs in (("mixtral", MODELS["mixtral"]),
                         ("qwen3_moe", {**MODELS["qwen3_moe"], "mlp_only_layers": []}),
                         ("gemma3", MODELS["gemma3"]), ("phi3", MODELS["phi3"])):
        folder = make_tiny_model(tmp_path / name / "hf", **kwargs)
        path = write_tiny_gguf(folder, tmp_path / name / "model.gguf")
        llm = LLM(path, dtype="float32", num_kv_blocks=32,
                  activation_quantization="none")
        ref = load_reference_model(folder)
        with LlamaServer(exe, path, slots=1, ctx_per_slot=256, threads=2) as server:
            for i, prompt in enumerate(_prompts(3, seed=5)):
                theirs = _post(f"{server.url}/completion", {
                    "prompt": prompt, "n_predict": NEW, "ignore_eos": True,
                    "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True}, 120)["tokens"]
                # llama.cpp's ignore_eos bans its end-of-generation tokens (</s> and
                # <|im_end|> here): so does this request
                ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
                    temperature=0, max_tokens=NEW, ignore_eos=True,
                    logit_bias={TINY_EOS_ID: -100, TINY_IM_END_ID: -100}))[0].outputs[0].token_ids
                _, gaps = reference_greedy(ref, prompt, NEW, [])
                # llama.cpp keeps its KV cache in float16: a near-tie may go either way
                assert_greedy_parity(list(ours), list(theirs), gaps, f"{name} {i}",
                                     tie_gap=LLAMA_CPP_TIE_GAP)


def test_tensor_parallel_2_splits_the_experts_codes(tmp_path):
    """At tensor-parallel size 2 each rank holds its slice of every expert's
    codes (gate and up rows; down's columns, whole Q4_1 blocks of 32 a rank)
    and the two give one rank's tokens and logprobs."""
    from tests.model.quantization.checkpoints import assert_tensor_parallel_2_matches
    folder = make_tiny_model(tmp_path / "hf", **{**MODELS["qwen3_moe"],
                                                  "moe_intermediate_size": 64})
    path = write_tiny_gguf(folder, tmp_path / "q.gguf", "Q4_1")
    assert_tensor_parallel_2_matches(path, _prompts(3, seed=4))
