"""GPTQ checkpoints made by gptqmodel 7.6.0 (tests/fixtures/quant): 4-bit
symmetric, asymmetric and act-order, 8-bit; group size 32.

Two references:
- an exact float copy: the format's formula w = (q - zero) * scale applied by
  this test's own code, run by transformers in fp32. Folio's packed layers
  match it to fp32 rounding (atol 2e-4 on logits of magnitude ~10), and its
  greedy tokens equal transformers' on it;
- the logits gptqmodel's own kernel gave through transformers when the
  fixture was made. That kernel casts activations to bfloat16 on the CPU
  (tests/fixtures/quant/README.md): its 4-bit logits are 0.16-0.28 away from
  the exact float copy's, its 8-bit ones 0.014-0.016. So the tolerance
  against it is the tool's own: max |logit difference| within 5% (4-bit) or
  0.5% (8-bit) of the largest logit, and the same top token wherever its
  top-2 gap is wider than that difference.
"""

import json

import pytest
import torch

from folio import LLM
from tests.model.quantization.checkpoints import (
    FIXTURES, FP32, assert_greedy_tokens_equal, assert_logits_match, assert_tensor_parallel_2_matches,
    assert_within_bf16_error, assert_within_the_tools_tolerance, copy_fixture, edit_tensors,
    float_model, kernel_or_torch, reference, unpack, update_quantization_config, use_kernel,
    write_float_copy)

NAMES = ["gptq-w4-g32-sym", "gptq-w4-g32-asym", "gptq-w4-g32-descact", "gptq-w8-g32-sym"]


def _bits(name):
    return json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]["bits"]


def gptq_formula(bits):
    def dequantize(tensors, prefix, kind):
        if kind != "qweight":
            return None
        q = unpack(tensors[f"{prefix}.qweight"], bits, 0)            # [in, out]
        zero = unpack(tensors[f"{prefix}.qzeros"], bits, 1) + 1      # v1: stored zero - 1
        scale = tensors[f"{prefix}.scales"].float()
        g = tensors[f"{prefix}.g_idx"].long()
        return ((q.float() - zero[g].float()) * scale[g]).t()
    return dequantize


@pytest.fixture(scope="module")
def float_copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {name: write_float_copy(name, gptq_formula(_bits(name)), root / name)
            for name in NAMES}


def _prompts(name):
    return [prompt for prompt, _ in reference(name)]


@kernel_or_torch
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_exact_float_copy(name, kernel, float_copies, monkeypatch):
    use_kernel(kernel, monkeypatch)
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_logits_match(llm, float_model(float_copies[name]), _prompts(name), 2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_logits_within_the_tools_tolerance_of_its_reference(name):
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_within_the_tools_tolerance(llm, name, 0.05 if _bits(name) == 4 else 0.005)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_exact_weights(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_greedy_tokens_equal(llm, float_model(float_copies[name]), _prompts(name), name)


@pytest.mark.parametrize("name", ["gptq-w4-g32-asym", "gptq-w8-g32-sym"])
def test_bf16_activations_stay_within_bf16_error(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="bfloat16", **FP32, num_kv_blocks=32)
    assert_within_bf16_error(llm, float_model(float_copies[name]), _prompts(name), 0.06)


def test_layers_keep_only_the_packed_form():
    llm = LLM(str(FIXTURES / "gptq-w4-g32-descact"), dtype="float32", **FP32, num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    layer = model.model.layers[0].mlp.down_proj
    assert layer.qweight.numel() == 0 and layer.scales.numel() == 0
    w = layer.quant_method.weights
    assert (w.bits, w.out_features, w.in_features) == (4, 128, 256)
    assert w.perm is not None                                  # act-order
    assert w.codes.numel() == 128 * 256 // 2


@pytest.mark.parametrize("name", ["gptq-w4-g32-asym", "gptq-w4-g32-descact"])
def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs(name):
    """Column-parallel layers split qweight, zeros and scales along the
    output; row-parallel ones split qweight and g_idx along the input, and
    act-order keeps every group's scales on each rank."""
    assert_tensor_parallel_2_matches(FIXTURES / name, _prompts(name))


# --------------------------------------------------------------------------- bad input

SYM = "gptq-w4-g32-sym"


def test_unsupported_bits_and_options_are_refused_by_name(tmp_path):
    folder = copy_fixture(tmp_path, SYM)
    update_quantization_config(folder, bits=3)
    with pytest.raises(ValueError, match="GPTQ with 3-bit weights is not supported; "
                                         "supported: 4, 8 bits"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, bits=4, lm_head=True)
    with pytest.raises(ValueError, match="quantized lm_head is not supported"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, lm_head=False, checkpoint_format="marlin")
    with pytest.raises(ValueError, match="checkpoint_format 'marlin' is not supported"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_a_group_size_the_tensors_do_not_have_is_caught_at_load(tmp_path):
    folder = copy_fixture(tmp_path, SYM)
    update_quantization_config(folder, group_size=64)
    with pytest.raises(ValueError, match=r"\.qzeros: checkpoint tensor of shape \(4, \d+\) "
                                         r"does not fit parameter of shape \(2, \d+\)"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    # in groups of 48: 128 inputs make three groups (the last of 32), not the
    # four stored; 256 make six, not eight
    update_quantization_config(folder, group_size=48)
    with pytest.raises(ValueError, match=r"\.qzeros: checkpoint tensor of shape \((4|8), \d+\) "
                                         r"does not fit parameter of shape \((3|6), \d+\)"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_a_last_group_shorter_than_the_others_follows_the_formula():
    """gptqmodel writes 576 inputs in groups of 128 as five groups, the last of
    64 (SmolLM2's hidden size): here 80 inputs in groups of 32."""
    from folio.model.layers.linear import ColumnParallelLinear, process_weights_after_loading
    from folio.model.layers.quantization import get_quantization_config
    config = get_quantization_config("gptq", {"bits": 4, "group_size": 32, "sym": False})
    layer = ColumnParallelLinear(80, 16, False, torch.float32, config, "x.q_proj")
    g = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=g,
                                         dtype=torch.int64).to(torch.int32)
    tensors = {"qweight": words(10, 16), "qzeros": words(3, 2),
               "scales": torch.rand(3, 16, generator=g).half(),
               "g_idx": (torch.arange(80) // 32).to(torch.int32)}
    for name, value in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), value)
    expect = gptq_formula(4)({f"x.{k}": v for k, v in tensors.items()}, "x", "qweight")
    process_weights_after_loading(layer)
    assert torch.equal(layer.quant_method.weights.dequantize(), expect)


def test_a_flag_that_names_another_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--quantization awq does not match the checkpoint, "
                                         "whose weights are gptq"):
        LLM(str(FIXTURES / SYM), quantization="awq", **FP32, num_kv_blocks=16)


def test_a_corrupt_group_index_is_caught_at_load(tmp_path):
    folder = copy_fixture(tmp_path, SYM)

    def corrupt(tensors):
        tensors["model.layers.1.self_attn.o_proj.g_idx"][5] = 9
    edit_tensors(folder, corrupt)
    with pytest.raises(ValueError, match="o_proj: GPTQ g_idx holds groups outside 0..3"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_a_truncated_checkpoint_is_caught_at_load(tmp_path):
    folder = copy_fixture(tmp_path, SYM)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200_000])
    with pytest.raises(Exception, match="(?i)safetensors|incomplete|truncat|invalid"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
