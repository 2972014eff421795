"""GGUF's Q4_0, Q4_1 and Q8_0 linear weights run in their codes: the same
weights transformers' GGUF reader dequantizes (exactly: tests/model/
test_loader.py), so Folio's logits match transformers on the dequantized
model to fp32 rounding and its greedy tokens equal transformers'. Other types
(the K-quants, Q5_x) and fused layers whose projections differ in type are
dequantized at load as before."""

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model import gguf_loader, native
from folio.model.layers.quantization.int_groups import IntGroupsLinear
from folio.model.layers.linear import PlainLinearMethod
from tests.model.quantization.checkpoints import folio_logits
from tests.parity import assert_greedy_parity, reference_greedy
from tests.utils import load_reference_model, make_tiny_model, write_tiny_gguf

PROMPTS = [[1, 20, 30, 40, 50, 60, 70, 80], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300]]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    folder = make_tiny_model(root / "hf", intermediate_size=128)
    return {q: write_tiny_gguf(folder, root / f"{q}.gguf", q) for q in ("Q4_0", "Q4_1", "Q8_0",
                                                                      "Q5_0")}


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_layers_match_transformers_on_the_dequantized_model(tiny_ggufs, qtype, kernel,
                                                                    monkeypatch):
    if kernel and not native.runs_qlinear(torch.zeros(1)):
        pytest.skip("no quantized linear kernel on this machine")
    if not kernel:
        monkeypatch.setattr(native, "runs_qlinear", lambda x: False)
    path = tiny_ggufs[qtype]
    llm = LLM(path, dtype="float32", num_kv_blocks=32)
    layer = llm.engine.executor.runner.model.model.layers[1].mlp.gate_up_proj
    assert isinstance(layer.quant_method, IntGroupsLinear)
    assert layer.quant_method.weights.bits == (8 if qtype == "Q8_0" else 4)
    reference = load_reference_model(path, dtype=torch.float32)
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, :-1]
        assert (folio_logits(llm, prompt) - theirs).abs().max().item() < 2e-4
        ref, gaps = reference_greedy(reference, prompt, 24, ())
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
        assert_greedy_parity(list(out.outputs[0].token_ids), ref, gaps, qtype)


def test_other_types_still_load_as_float(tiny_ggufs):
    path = tiny_ggufs["Q5_0"]
    llm = LLM(path, dtype="float32", num_kv_blocks=16)
    layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert llm.engine.config.model.quantization is None
    assert not isinstance(layer.quant_method, IntGroupsLinear)


def test_a_fused_layer_runs_packed_only_if_its_projections_share_a_type():
    class T:
        def __init__(self, name, kind):
            self.name, self.tensor_type = name, type("K", (), {"name": kind})

    class Reader:
        tensors = [T("blk.0.attn_q.weight", "Q4_0"), T("blk.0.attn_k.weight", "Q4_0"),
                   T("blk.0.attn_v.weight", "Q8_0"), T("blk.0.attn_output.weight", "Q4_0"),
                   T("blk.0.ffn_gate.weight", "Q4_1"), T("blk.0.ffn_up.weight", "Q4_1"),
                   T("blk.0.ffn_down.weight", "Q6_K"), T("blk.0.attn_norm.weight", "F32")]

    assert gguf_loader.packed_linear_tensors(Reader) == {
        "model.layers.0.self_attn.o_proj.weight": "Q4_0",
        "model.layers.0.mlp.gate_proj.weight": "Q4_1",
        "model.layers.0.mlp.up_proj.weight": "Q4_1"}
    from folio.model.layers.quantization import get_quantization_config
    config = get_quantization_config("gguf", {"packed": gguf_loader.packed_linear_tensors(Reader)})
    assert isinstance(config.get_linear_method(None, "model.layers.0.self_attn.qkv_proj"),
                      PlainLinearMethod)
    assert config.get_linear_method(None, "model.layers.0.mlp.gate_up_proj").kind == "Q4_1"


def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs(tiny_ggufs):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    path = tiny_ggufs["Q4_1"]
    expect = LLM(path, dtype="float32", num_kv_blocks=32).generate(prompts, params,
                                                                   use_tqdm=False)
    two = LLM(path, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        got = two.generate(prompts, params, use_tqdm=False)
    finally:
        two.shutdown()
    for a, b in zip(expect, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                          b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t] - pb[t]) < 1e-4 for t in pa)


def test_the_default_model_keeps_its_linear_weights_in_four_bits():
    llm = LLM(dtype="float32", num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    methods = [m.quant_method for m in model.modules() if hasattr(m, "quant_method")]
    assert len(methods) == 30 * 4 and all(isinstance(m, IntGroupsLinear) for m in methods)
    linear_bytes = sum(m.weights.nbytes for m in methods)
    params = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    # half a byte a weight, and a float16 scale and min per 32
    assert linear_bytes <= params * (0.5 + 4 / 32) + 30 * 4 * 16 * 1536
