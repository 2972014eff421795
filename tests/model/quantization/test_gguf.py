"""GGUF's Q4_0, Q4_1 and Q8_0 linear weights run in their codes: the same
weights transformers' GGUF reader dequantizes (exactly: tests/model/
test_loader.py), so Folio's logits match transformers on the dequantized
model to fp32 rounding and its greedy tokens equal transformers'. Other types
(Q5_x, Q2_K, Q3_K), and fused layers with a part of such a type, are
dequantized at load as before. The K-quants: test_gguf_kquants.py."""

import pytest
import torch

from folio import LLM
from folio.model import gguf_loader
from folio.model.layers.quantization.int_groups import IntGroupsLinear
from folio.model.layers.linear import PlainLinearMethod
from tests.model.quantization.checkpoints import (FP32, assert_greedy_tokens_equal,
                                                  assert_logits_match,
                                                  assert_tensor_parallel_2_matches,
                                                  kernel_or_torch, use_kernel)
from tests.utils import load_reference_model, make_tiny_model, write_tiny_gguf

PROMPTS = [[1, 20, 30, 40, 50, 60, 70, 80], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300]]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    folder = make_tiny_model(root / "hf", intermediate_size=128)
    return {q: write_tiny_gguf(folder, root / f"{q}.gguf", q) for q in ("Q4_0", "Q4_1", "Q8_0",
                                                                      "Q5_0")}


@kernel_or_torch
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_layers_match_transformers_on_the_dequantized_model(tiny_ggufs, qtype, kernel,
                                                                    monkeypatch):
    use_kernel(kernel, monkeypatch)
    path = tiny_ggufs[qtype]
    llm = LLM(path, dtype="float32", **FP32, num_kv_blocks=32)
    layer = llm.engine.executor.runner.model.model.layers[1].mlp.gate_up_proj
    assert isinstance(layer.quant_method, IntGroupsLinear)
    assert layer.quant_method.weights.bits == (8 if qtype == "Q8_0" else 4)
    reference = load_reference_model(path, dtype=torch.float32)
    assert_logits_match(llm, reference, PROMPTS, 2e-4)
    assert_greedy_tokens_equal(llm, reference, PROMPTS, qtype)


def test_other_types_still_load_as_float(tiny_ggufs):
    path = tiny_ggufs["Q5_0"]
    llm = LLM(path, dtype="float32", **FP32, num_kv_blocks=16)
    layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert llm.engine.config.model.quantization is None
    assert not isinstance(layer.quant_method, IntGroupsLinear)


def test_a_fused_layer_runs_packed_only_if_each_projection_is_packable():
    class T:
        def __init__(self, name, kind):
            self.name, self.tensor_type = name, type("K", (), {"name": kind})

    class Reader:
        fields: dict = {}                # no metadata: general.architecture absent
        tensors = [T("blk.0.attn_q.weight", "Q4_0"), T("blk.0.attn_k.weight", "Q4_0"),
                   T("blk.0.attn_v.weight", "Q8_0"), T("blk.0.attn_output.weight", "Q4_0"),
                   T("blk.0.ffn_gate.weight", "Q4_1"), T("blk.0.ffn_up.weight", "Q5_0"),
                   T("blk.0.ffn_down.weight", "Q6_K"), T("blk.0.attn_norm.weight", "F32")]

    assert gguf_loader.packed_linear_tensors(Reader) == {
        "model.layers.0.self_attn.q_proj.weight": "Q4_0",
        "model.layers.0.self_attn.k_proj.weight": "Q4_0",
        "model.layers.0.self_attn.v_proj.weight": "Q8_0",
        "model.layers.0.self_attn.o_proj.weight": "Q4_0",
        "model.layers.0.mlp.down_proj.weight": "Q6_K"}
    from folio.model.layers.quantization import get_quantization_config
    config = get_quantization_config("gguf", {"packed": gguf_loader.packed_linear_tensors(Reader)})
    qkv = config.get_linear_method(None, "model.layers.0.self_attn.qkv_proj")
    assert (qkv.kind, qkv.bits, qkv.group) == ("Q4_0+Q8_0", 8, 32)      # the widest codes
    assert isinstance(config.get_linear_method(None, "model.layers.0.mlp.gate_up_proj"),
                      PlainLinearMethod)                                 # Q5_0 is not packed
    down = config.get_linear_method(None, "model.layers.0.mlp.down_proj")
    assert (down.kind, down.bits, down.group) == ("Q6_K", 6, 16)
    assert down.two_level and not qkv.two_level      # a K-quant's int8s under their d


def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs(tiny_ggufs):
    assert_tensor_parallel_2_matches(tiny_ggufs["Q4_1"], PROMPTS)


def test_the_default_model_keeps_its_weights_in_their_codes():
    """Q4_1 linear layers and the Q8_0 embedding, which the tied LM head
    multiplies by: one packed copy, the float table nowhere."""
    llm = LLM(dtype="float32", **FP32, num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    methods = [m.quant_method for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), IntGroupsLinear)]
    assert len(methods) == 30 * 4 + 1
    embedding = model.model.embed_tokens
    assert embedding.packed_table.bits == 8 and not hasattr(embedding, "weight")
    assert model.lm_head.tied and not hasattr(model.lm_head, "weight")
    linear_bytes = sum(m.weights.nbytes for m in methods if m is not embedding.quant_method)
    params = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    # half a byte a weight, and a float16 scale and min per 32
    assert linear_bytes <= params * (0.5 + 4 / 32) + 30 * 4 * 16 * 1536
    assert embedding.packed_table.nbytes <= 49152 * 576 * (1 + 4 / 32) + 128     # + bounds


def test_rows_of_a_packed_table_are_its_dequantized_rows(tiny_ggufs):
    llm = LLM(tiny_ggufs["Q8_0"], dtype="float32", **FP32, num_kv_blocks=16)
    table = llm.engine.executor.runner.model.model.embed_tokens.packed_table
    ids = torch.tensor([[0, 5, 383], [17, 17, 2]])
    assert torch.equal(table.dequantize_rows(ids), table.dequantize()[ids])
