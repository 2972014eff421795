"""Mixtral and Qwen3-MoE beyond test_parity_tiny.py's greedy cases, each against
transformers on a tiny random checkpoint it saved: the config read as each
family spells it, the experts loaded into the stacked tensors, dense and MoE
layers where Qwen3-MoE's config puts them, a prefix-cache hit, tensor
parallelism 2 and prompt logprobs; a missing expert named; `-q int8|int4`
quantizing the experts (checkpoints whose experts are stored quantized:
tests/model/quantization/test_moe_checkpoints.py); the one-call native
decoder taken where the experts' kernels are native."""

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio import LLM, SamplingParams
from folio.kernels import native
from folio.model.layers.moe import FusedMoE
from folio.model.llama import LlamaMLP
from folio.model.loader import load_model_config
from folio.model.native_decoder import NativeDecoder
from tests.parity import (assert_greedy_parity, assert_prefix_hit_parity,
                          assert_tp2_greedy_parity, prompt_logprobs, reference_greedy,
                          reference_prompt_logprobs)
from tests.utils import load_reference_model, make_tiny_model

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
MODELS = {
    "mixtral": dict(arch="mixtral", dialect="v5", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=48),
    # three layers: MoE, dense (mlp_only_layers), MoE; top-2 of 8 not renormalized
    "qwen3_moe": dict(arch="qwen3_moe", dialect="v5", num_hidden_layers=3, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                      norm_topk_prob=False, head_dim=32),
}


@pytest.fixture(scope="module", params=list(MODELS))
def moe_model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **MODELS[request.param])
    return request.param, path, load_reference_model(path)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 384) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def test_the_config_and_the_experts_are_the_checkpoints(moe_model):
    name, path, ref = moe_model
    cfg = load_model_config(path)
    if name == "mixtral":
        assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == (
            "MixtralForCausalLM", 4, 48)
        assert cfg.norm_topk_prob
        moe_layers = [0, 1]
    else:
        assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == (
            "Qwen3MoeForCausalLM", 8, 32)
        assert not cfg.norm_topk_prob and cfg.mlp_only_layers == (1,)
        moe_layers = [0, 2]
    assert cfg.num_experts_per_tok == 2
    llm = LLM(path, dtype="float32", num_kv_blocks=32)
    model = llm.engine.executor.runner.model
    for i, (ours, theirs) in enumerate(zip(model.model.layers, ref.model.layers)):
        if i not in moe_layers:
            assert isinstance(ours.mlp, LlamaMLP)
            continue
        assert isinstance(ours.mlp, FusedMoE)
        assert torch.equal(ours.mlp.gate.weight, theirs.mlp.gate.weight)
        # transformers keeps them stacked the same way in memory: gate rows, then up
        assert torch.equal(ours.mlp.w13_weight, theirs.mlp.experts.gate_up_proj)
        assert torch.equal(ours.mlp.w2_weight, theirs.mlp.experts.down_proj)
    # fp32 experts are packed for no native kernel: the one-call decoder
    # declines them, the modules run
    assert model.model.native_decoder is None
    assert NativeDecoder.build(list(model.model.layers)) is None


def test_bf16_on_the_cpu(moe_model):
    """bf16: where the CPU has the native bf16 kernel, a MoE model packs its
    weights for it, even on an AMX CPU whose native kernel has no AMX path
    (where a dense model keeps oneDNN: the experts see a few rows a step);
    without it, every weight is kept as bf16
    for the AVX2 kernel; either way the one-call native decoder takes its
    layers (tests/model/test_native_decoder.py compares the two paths)."""
    _, path, _ = moe_model
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=32)
    model = llm.engine.executor.runner.model
    # without native bf16: fp32 arithmetic on bf16-stored weights (the AVX2 kernel)
    kind = ("bf16" if native.has_bf16_linear() else
            "bf16_weights" if native.packs_linear_bf16w(torch.zeros(8, 8)) else None)
    layer = model.model.layers[0]
    kinds = {m.native_kind for pair in layer.mlp.packed_experts or () for m in pair}
    assert kinds | {layer.self_attn.qkv_proj.quant_method.native_kind} == {kind}
    assert (model.model.native_decoder is not None) == (kind is not None)
    # the preference is the MoE model's alone: oneDNN again on an AMX CPU whose
    # native kernel has no AMX path
    assert native.prefers_onednn_bf16() == ("amx_bf16" in native._cpu_flags().split()
                                            and not native.has_amx_linear())
    # the run dtype: bf16 where the CPU multiplies it natively, else fp32 (the
    # split path, whose bf16-stored weights are the dense linear layers')
    assert model.model.layers[0].mlp.w13_weight.dtype == getattr(torch, llm.engine.config.dtype)
    out = llm.generate({"prompt_token_ids": _prompts(1, 4)[0]}, PARAMS)[0].outputs[0]
    assert len(out.token_ids) == NEW


def test_a_prefix_hit_gives_transformers_tokens(moe_model):
    _, path, ref_model = moe_model
    assert_prefix_hit_parity(path, ref_model, NEW)


def test_tensor_parallel_2_gives_transformers_tokens(moe_model):
    """Each rank holds half of every expert's intermediate size."""
    _, path, ref_model = moe_model
    assert_tp2_greedy_parity(path, ref_model, _prompts(3, 5), NEW)


def test_prompt_logprobs_match_transformers(moe_model):
    _, path, ref_model = moe_model
    [ids] = _prompts(1, 9)
    got = prompt_logprobs(LLM(path, dtype="float32", num_kv_blocks=32), ids)
    assert torch.allclose(got, reference_prompt_logprobs(ref_model, ids), atol=1e-4)


def test_transformers_fused_expert_tensors_load_too(moe_model, tmp_path):
    """save_pretrained(save_original_format=False) stores each layer's experts as
    two 3-D tensors (and Mixtral's router under mlp.gate): the same model."""
    _, path, ref_model = moe_model
    folder, fused = tmp_path / "fused", tmp_path / "saved"
    shutil.copytree(path, folder)
    ref_model.save_pretrained(fused, save_original_format=False)
    names = load_file(str(fused / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    shutil.copy(fused / "model.safetensors", folder / "model.safetensors")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    layer = llm.engine.executor.runner.model.model.layers[0].mlp
    assert torch.equal(layer.w13_weight, ref_model.model.layers[0].mlp.experts.gate_up_proj)
    assert torch.equal(layer.gate.weight, ref_model.model.layers[0].mlp.gate.weight)
    [ids] = _prompts(1, 11)
    out = llm.generate({"prompt_token_ids": ids}, PARAMS)[0].outputs[0]
    ref, gaps = reference_greedy(ref_model, ids, NEW, ())
    assert_greedy_parity(out.token_ids, ref, gaps, label="fused tensors")


def test_a_missing_expert_is_named(moe_model, tmp_path):
    name, path, _ = moe_model
    folder = tmp_path / "cut"
    shutil.copytree(path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    gone = ("model.layers.1.block_sparse_moe.experts.3.w3.weight" if name == "mixtral"
            else "model.layers.2.mlp.experts.5.down_proj.weight")
    del tensors[gone]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"checkpoint lacks weights for: \\['{gone}'\\]"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


def test_quantization_flags_quantize_the_experts(moe_model):
    """`-q int8|int4`: every expert matrix in RTN's codes, as the dense layers'
    are (that the layer computes exactly on them: tests/model/layers/test_moe.py);
    the experts' bytes drop to about a byte (int8) or half a byte (int4) a
    weight; the logprobs move from the float model's, int4 more than int8 (these
    tiny random models move as much under a dense model's quantization)."""
    from folio.model.layers.moe import ExpertMatrix
    _, path, _ = moe_model
    floats = LLM(path, dtype="float32", num_kv_blocks=32)
    ids = _prompts(1, 6)[0]
    first = next(m for m in floats.engine.executor.runner.model.modules()
                 if isinstance(m, FusedMoE))
    full = sum(p.numel() * p.element_size() for p in (first.w13_weight, first.w2_weight))
    drift = {}
    for method, bits, share in (("int8", 8, 0.4), ("int4", 4, 0.3)):
        llm = LLM(path, dtype="float32", num_kv_blocks=32, quantization=method,
                  activation_quantization="none")
        model = llm.engine.executor.runner.model
        moe = next(m for m in model.modules() if hasattr(m, "packed_experts"))
        assert all(isinstance(m, ExpertMatrix) and m.weights.bits == bits
                   for pair in moe.packed_experts for m in pair)
        held = sum(m.weights.nbytes for pair in moe.packed_experts for m in pair)
        assert held < full * share and moe.w13_weight.numel() == 0       # fp32: 4 bytes
        drift[method] = (prompt_logprobs(llm, ids) - prompt_logprobs(floats, ids)).abs().max()
    assert drift["int8"] < 1.0 and drift["int8"] < drift["int4"], drift


def test_mixtral_attends_to_its_window_past_it(tmp_path):
    """A Mixtral sliding_window is every layer's, as Mistral's
    (tests/engine/test_sliding_window.py): the context is not capped at it,
    and the tokens past it are transformers'."""
    path = make_tiny_model(tmp_path / "w", **MODELS["mixtral"], sliding_window=24)
    cfg = load_model_config(path)
    assert (cfg.max_position_embeddings, cfg.sliding_window, cfg.kv_window) == (512, 24, 24)
    ids = _prompts(1, 8)[0]
    assert len(ids) > 24
    ref, gaps = reference_greedy(load_reference_model(path), ids, NEW, ())
    llm = LLM(path, dtype="float32", num_kv_blocks=32, block_size=8)
    assert llm.engine.scheduler.kv.window == 24
    out = llm.generate({"prompt_token_ids": ids}, PARAMS)[0].outputs[0]
    assert_greedy_parity(out.token_ids, ref, gaps, label="mixtral window")
