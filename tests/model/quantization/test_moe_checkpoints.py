"""Mixture-of-experts checkpoints whose experts are stored quantized, made by
the tools users make them with (tests/fixtures/quant, by
scripts/make_moe_quant_fixtures.sh): GPTQ on a tiny Qwen3-MoE and AWQ on a
tiny Mixtral (gptqmodel 7.6.0, which saves Mixtral's experts under
transformers 5's names, mlp.experts.E.gate_proj), compressed-tensors W4A16 on
the Qwen3-MoE (llm-compressor 0.14.0.1, the router left in float).

Each expert's matrices load through their format's linear method and are held
as IntGroups (issue 29), never as floats. The references are the dense
formats' (test_gptq.py): an exact float copy (the format's formula applied by
this test's code) run by transformers in fp32, which Folio matches to fp32
rounding and whose greedy tokens it gives; and the logits the tool's own
kernels gave through transformers (bf16 activations for gptqmodel's), within
the tool's tolerance.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio import LLM
from folio.bench.weights import loaded_bytes
from folio.kernels import native
from folio.model.layers.moe import ExpertMatrix, FusedMoE
from tests.model.quantization.checkpoints import (
    FIXTURES, FP32, assert_greedy_tokens_equal, assert_logits_match, assert_tensor_parallel_2_matches,
    assert_within_bf16_error, assert_within_the_tools_tolerance, copy_fixture, edit_tensors,
    hf_logits, kernel_or_torch, reference, use_kernel, write_float_copy)
from tests.model.quantization.test_awq import awq_formula
from tests.model.quantization.test_compressed_tensors import ct_formula
from tests.model.quantization.test_gptq import gptq_formula

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

FORMULAS = {"gptq-qwen3moe-w4-g32": gptq_formula(4), "awq-mixtral-w4-g32": awq_formula(),
            "ct-qwen3moe-w4a16-g32": ct_formula(4)}
NAMES = list(FORMULAS)
# Mixtral's own checkpoint names, which transformers reads a float Mixtral by
MIXTRAL = {".mlp.gate.": ".block_sparse_moe.gate.", ".mlp.experts.": ".block_sparse_moe.experts.",
           ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def _float_copy(name, out):
    folder = write_float_copy(name, FORMULAS[name], out)
    if name.startswith("awq-mixtral"):
        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        renamed = {}
        for key, value in tensors.items():
            for theirs, ours in MIXTRAL.items():
                key = key.replace(theirs, ours)
            renamed[key] = value
        save_file(renamed, str(path))
    return folder


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    """transformers' fp32 model of each exact float copy, every tensor read
    (none missing, none left over)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("float")
    models = {}
    for name in NAMES:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(_float_copy(name, root / name)), dtype=torch.float32, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        models[name] = model.eval()
    return models


def _prompts(name):
    return [prompt for prompt, _ in reference(name)]


def _moe_layers(llm):
    return [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]


@kernel_or_torch
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_exact_float_copy(name, kernel, float_models, monkeypatch):
    use_kernel(kernel, monkeypatch)
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_logits_match(llm, float_models[name], _prompts(name), 2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_logits_within_the_tools_tolerance_of_its_reference(name):
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_within_the_tools_tolerance(llm, name, 0.05)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_exact_weights(name, float_models):
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_greedy_tokens_equal(llm, float_models[name], _prompts(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_are_held_in_their_codes(name):
    """Every expert matrix an IntGroups of 4-bit codes (the per-expert layers
    they loaded through are dropped once prepared, the float stacks never
    made); the weight report counts them once, at about half a byte a weight;
    the one-call native decoder runs them where the CPU has the kernel."""
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    model = llm.engine.executor.runner.model
    layers = _moe_layers(llm)
    assert len(layers) == 2
    weights = 0
    for moe in layers:
        assert moe.experts is None and moe.w13_weight.numel() == moe.w2_weight.numel() == 0
        assert len(moe.packed_experts) == 4
        for gate_up, down in moe.packed_experts:
            assert isinstance(gate_up, ExpertMatrix) and isinstance(down, ExpertMatrix)
            assert (gate_up.weights.bits, gate_up.weights.out_features,
                    gate_up.weights.in_features) == (4, 128, 128)
            assert (down.weights.out_features, down.weights.in_features) == (128, 64)
            weights += gate_up.weights.nbytes + down.weights.nbytes
    report = loaded_bytes(model)
    assert report["linear_formats"]["packed experts"] == 2
    experts = 2 * 4 * 3 * 128 * 64                                 # weights
    assert experts // 2 < weights < experts * 0.7                  # codes + group scales
    assert report["bytes"]["linear"] < weights + 2 * 4 * 128 * 128 * 4   # + attention's, fp32 max
    assert (model.model.native_decoder is not None) == native.runs_qlinear(torch.zeros(1))


def test_bf16_activations_stay_within_bf16_error(float_models):
    name = "gptq-qwen3moe-w4-g32"
    llm = LLM(str(FIXTURES / name), dtype="bfloat16", **FP32, num_kv_blocks=32)
    assert_within_bf16_error(llm, float_models[name], _prompts(name), 0.06)


@pytest.mark.parametrize("name", ["gptq-qwen3moe-w4-g32", "awq-mixtral-w4-g32"])
def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs(name):
    """Each rank holds a slice of every expert: gate and up split along their
    outputs, down along its inputs (whole groups of 32 per rank)."""
    assert_tensor_parallel_2_matches(FIXTURES / name, _prompts(name))


def test_a_missing_expert_tensor_is_named(tmp_path):
    folder = copy_fixture(tmp_path, "ct-qwen3moe-w4a16-g32")
    edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight_scale"))
    with pytest.raises(ValueError, match="checkpoint lacks weights for: "
                                         r"\['model.layers.1.mlp.experts.3.down_proj.weight_scale'\]"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


def test_an_expert_of_the_wrong_shape_is_caught_at_load(tmp_path):
    folder = copy_fixture(tmp_path, "gptq-qwen3moe-w4-g32")
    key = "model.layers.0.mlp.experts.2.up_proj.qweight"
    edit_tensors(folder, lambda t: t.update({key: t[key][:8]}))
    with pytest.raises(ValueError, match=f"{key}: checkpoint tensor of shape"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


def test_the_float_copy_is_what_transformers_runs(float_models):
    """The references are sound: transformers on the exact float copy is
    within the tool's tolerance of the tool's own logits too."""
    for name, model in float_models.items():
        for prompt, logits in reference(name):
            diff = (hf_logits(model, prompt) - logits[:-1]).abs().max().item()
            assert diff < 0.05 * logits.abs().max().item(), name


def test_experts_a_format_leaves_in_float_load_as_floats(tmp_path, float_models):
    """compressed-tensors' `ignore` may leave the experts unquantized (their
    float `.weight` in the checkpoint beside quantized attention): they load
    and run as float weights, packed where the CPU packs them."""
    name = "ct-qwen3moe-w4a16-g32"
    folder = copy_fixture(tmp_path, name)
    exact = load_file(str(write_float_copy(name, FORMULAS[name], tmp_path / "float")
                          / "model.safetensors"))

    def floats_for_experts(tensors):
        for key in [k for k in tensors if ".mlp.experts." in k]:
            del tensors[key]
        tensors.update({k: v for k, v in exact.items() if ".mlp.experts." in k})
    edit_tensors(folder, floats_for_experts)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:.*mlp[.]experts[.]")
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), dtype="float32", **FP32, num_kv_blocks=32)
    assert_logits_match(llm, float_models[name], _prompts(name), 2e-4)
    for moe in _moe_layers(llm):
        assert not any(isinstance(m, ExpertMatrix) for pair in moe.packed_experts for m in pair)
    report = loaded_bytes(llm.engine.executor.runner.model)
    assert report["bytes"]["linear"] > 2 * 4 * 3 * 128 * 64 * 4          # fp32 experts
