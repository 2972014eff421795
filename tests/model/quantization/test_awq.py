"""AWQ (GEMM layout) checkpoint made by gptqmodel 7.6.0 (tests/fixtures/quant/
awq-w4-g32): 4 bits, group size 32, zero points.

Two references:
- an exact float copy: AWQ's formula w = (q - zero) * scale, with its
  interleaved nibble order undone by this test's own code, run by
  transformers in fp32 (every other tensor, the norms AWQ folded its
  smoothing scales into among them, taken from the checkpoint as it is).
  Folio's packed layers match it to fp32 rounding (atol 2e-4 on logits of
  magnitude ~8), and its greedy tokens equal transformers' on it;
- the logits gptqmodel's TorchAtenAwqLinear gave through transformers when
  the fixture was made. That kernel casts activations to bfloat16, so those
  logits are ~0.17 away from the exact float copy's (README.md there): the
  tolerance against them is the tool's own, as for 4-bit GPTQ: max |logit
  difference| within 5% of the largest logit, and the same top token
  wherever the reference's top-2 gap is wider than twice that difference.
"""

import json

import pytest
import torch

from folio import LLM
from tests.model.quantization.checkpoints import (
    FIXTURES, FP32, assert_greedy_tokens_equal, assert_logits_match, assert_tensor_parallel_2_matches,
    assert_within_bf16_error, assert_within_the_tools_tolerance, copy_fixture,
    edit_quantization_config, float_model, folio_logits, kernel_or_torch, reference, unpack,
    update_quantization_config, use_kernel, write_float_copy)

NAME = "awq-w4-g32"
GROUP = 32
# nibble i of a word holds output column 8j + ORDER[i]
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_unpack(words):
    """[rows, out / 8] int32 in AWQ order -> [rows, out] codes in column order."""
    nibbles = unpack(words, 4, 1)                               # nibble order per word
    rows, cols = nibbles.shape
    nibbles = nibbles.view(rows, cols // 8, 8)
    columns = torch.empty_like(nibbles)
    for i, column in enumerate(ORDER):
        columns[..., column] = nibbles[..., i]
    return columns.view(rows, cols)


def awq_formula(zero_point=True):
    def dequantize(tensors, prefix, kind):
        if kind != "qweight":
            return None
        q = awq_unpack(tensors[f"{prefix}.qweight"])                # [in, out]
        scale = tensors[f"{prefix}.scales"].float()                 # [in / 32, out]
        zero = awq_unpack(tensors[f"{prefix}.qzeros"]).float() if zero_point \
            else torch.full_like(scale, 8.0)
        g = torch.arange(q.shape[0]) // GROUP
        return ((q.float() - zero[g]) * scale[g]).t()
    return dequantize


@pytest.fixture(scope="module")
def float_copy(tmp_path_factory):
    return write_float_copy(NAME, awq_formula(), tmp_path_factory.mktemp("float") / NAME)


def _prompts():
    return [prompt for prompt, _ in reference(NAME)]


def test_the_fixture_is_awq_gemm_with_folded_norms(float_copy):
    """What the fixture is: AWQ GEMM tensors, qweight packed along the output,
    and norms that are not the float model's ones (AWQ's smoothing scales)."""
    from safetensors.torch import load_file
    config = json.loads((FIXTURES / NAME / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["version"], config["bits"],
            config["group_size"], config["zero_point"]) == ("awq", "gemm", 4, 32, True)
    tensors = load_file(str(FIXTURES / NAME / "model.safetensors"))
    assert tensors["model.layers.0.mlp.gate_proj.qweight"].shape == (128, 256 // 8)
    assert tensors["model.layers.0.mlp.down_proj.qzeros"].shape == (256 // 32, 128 // 8)
    norm = tensors["model.layers.0.input_layernorm.weight"].float()
    assert not torch.allclose(norm, torch.ones_like(norm))


@kernel_or_torch
def test_logits_match_the_exact_float_copy(kernel, float_copy, monkeypatch):
    use_kernel(kernel, monkeypatch)
    llm = LLM(str(FIXTURES / NAME), dtype="float32", **FP32, num_kv_blocks=32)
    assert_logits_match(llm, float_model(float_copy), _prompts(), 2e-4)


def test_logits_within_the_tools_tolerance_of_its_reference():
    llm = LLM(str(FIXTURES / NAME), dtype="float32", **FP32, num_kv_blocks=32)
    assert_within_the_tools_tolerance(llm, NAME, 0.05)


def test_greedy_tokens_equal_transformers_on_the_exact_weights(float_copy):
    llm = LLM(str(FIXTURES / NAME), dtype="float32", **FP32, num_kv_blocks=32)
    assert_greedy_tokens_equal(llm, float_model(float_copy), _prompts(), NAME)


def test_bf16_activations_stay_within_bf16_error(float_copy):
    llm = LLM(str(FIXTURES / NAME), dtype="bfloat16", **FP32, num_kv_blocks=32)
    assert_within_bf16_error(llm, float_model(float_copy), _prompts(), 0.06)


def test_layers_keep_only_the_packed_form():
    llm = LLM(str(FIXTURES / NAME), dtype="float32", **FP32, num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.qweight.numel() == 0 and layer.qzeros.numel() == 0
    assert layer.scales.numel() == 0
    w = layer.quant_method.weights
    assert (w.bits, w.out_features, w.in_features) == (4, 512, 128)
    assert w.perm is None and w.zeros
    assert w.codes.numel() == 512 * 128 // 2


def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs():
    """Column-parallel layers split qweight and qzeros in whole packed words
    along the output, and scales; row-parallel ones split qweight's rows and
    the groups of qzeros and scales."""
    assert_tensor_parallel_2_matches(FIXTURES / NAME, _prompts())


# --------------------------------------------------------------------------- options


def test_autoawq_key_names_are_read(tmp_path):
    """AutoAWQ's config says w_bit, q_group_size and version "GEMM"."""
    folder = copy_fixture(tmp_path, NAME)

    def autoawq(config):
        config.clear()
        config.update({"quant_method": "AWQ", "w_bit": 4, "q_group_size": 32,
                       "zero_point": True, "version": "GEMM"})
    edit_quantization_config(folder, autoawq)
    ours = LLM(str(folder), dtype="float32", **FP32, num_kv_blocks=16)
    theirs = LLM(str(FIXTURES / NAME), dtype="float32", **FP32, num_kv_blocks=16)
    prompt = reference(NAME)[0][0]
    assert torch.equal(folio_logits(ours, prompt), folio_logits(theirs, prompt))


def test_zero_point_false_uses_the_symmetric_zero(tmp_path):
    """zero_point: false -> every zero is 8, whatever qzeros holds."""
    folder = copy_fixture(tmp_path, NAME)
    update_quantization_config(folder, zero_point=False)
    hf = float_model(write_float_copy(NAME, awq_formula(zero_point=False),
                                      tmp_path / "sym-float"))
    llm = LLM(str(folder), dtype="float32", **FP32, num_kv_blocks=16)
    assert_logits_match(llm, hf, _prompts()[:1], 2e-4)


# --------------------------------------------------------------------------- bad input


def test_unsupported_bits_and_options_are_refused_by_name(tmp_path):
    folder = copy_fixture(tmp_path, NAME)
    update_quantization_config(folder, bits=8)
    with pytest.raises(ValueError, match="AWQ with 8-bit weights is not supported; "
                                         "supported: 4 bits"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, bits=4, version="gemv")
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported; supported: gemm"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, version="gemm", format="gemv_fast")
    with pytest.raises(ValueError, match="AWQ format 'gemv_fast' is not supported"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, format="gemm", group_size=0)
    with pytest.raises(ValueError, match="AWQ group_size 0 is not valid"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, group_size=32, lm_head=True)
    with pytest.raises(ValueError, match="AWQ with a quantized lm_head is not supported"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_a_group_size_the_tensors_do_not_have_is_caught_at_load(tmp_path):
    folder = copy_fixture(tmp_path, NAME)
    update_quantization_config(folder, group_size=64)
    with pytest.raises(ValueError, match=r"\.qzeros: checkpoint tensor of shape \(4, \d+\) "
                                         r"does not fit parameter of shape \(2, \d+\)"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    update_quantization_config(folder, group_size=48)
    with pytest.raises(ValueError, match="AWQ group_size 48 does not divide the layer's 128 "
                                         "input features"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_row_parallel_ranks_must_get_whole_groups():
    """group_size 128 at tensor-parallel size 2: o_proj's 128 inputs are 64 a
    rank, half a group. Built as a layer at rank 0 of 2 (an engine whose
    workers fail to build their model leaves the driver's parallel state
    behind, so this does not start one)."""
    from folio.distributed.parallel_state import set_tensor_parallel
    from folio.model.layers.linear import ColumnParallelLinear, RowParallelLinear
    from folio.model.layers.quantization import get_quantization_config
    quant = get_quantization_config("awq", {"bits": 4, "group_size": 128, "version": "gemm"})
    set_tensor_parallel(0, 2)
    try:
        with pytest.raises(ValueError, match="o_proj: AWQ group_size 128: each of the 2 "
                                             "tensor-parallel ranks gets 64 of the layer's 128 "
                                             "input features, not whole groups"):
            RowParallelLinear(128, 128, False, torch.float32, quant, "model.layers.0.o_proj")
        # column-parallel layers keep every input: whole groups on each rank
        layer = ColumnParallelLinear(128, 256, False, torch.float32, quant, "gate_proj")
        assert layer.qweight.shape == (128, 128 // 8) and layer.scales.shape == (1, 128)
    finally:
        set_tensor_parallel(0, 1)


def test_a_flag_that_names_another_format_is_refused():
    with pytest.raises(ValueError, match="--quantization gptq does not match the checkpoint, "
                                         "whose weights are awq"):
        LLM(str(FIXTURES / NAME), quantization="gptq", **FP32, num_kv_blocks=16)
