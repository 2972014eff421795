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
import shutil

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model import native
from tests.model.quantization.checkpoints import (FIXTURES, folio_logits, reference, unpack,
                                                  write_float_copy)
from tests.parity import assert_greedy_parity, reference_greedy

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


def _hf(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_exact_float_copy(name, kernel, float_copies, monkeypatch):
    if kernel and not native.runs_qlinear(torch.zeros(1)):
        pytest.skip("no quantized linear kernel on this machine")
    if not kernel:
        monkeypatch.setattr(native, "runs_qlinear", lambda x: False)
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    hf = _hf(float_copies[name])
    for prompt, _ in reference(name):
        ours = folio_logits(llm, prompt)
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, :-1]
        assert (ours - theirs).abs().max().item() < 2e-4


@pytest.mark.parametrize("name", NAMES)
def test_logits_within_the_tools_tolerance_of_its_reference(name):
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    tolerance = 0.05 if _bits(name) == 4 else 0.005
    for prompt, logits in reference(name):
        ref = logits[:-1]
        ours = folio_logits(llm, prompt)
        diff = (ours - ref).abs().max().item()
        assert diff <= tolerance * ref.abs().max().item()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_exact_weights(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    hf = _hf(float_copies[name])
    for prompt, _ in reference(name):
        ref, gaps = reference_greedy(hf, prompt, 24, ())
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
        assert_greedy_parity(list(out.outputs[0].token_ids), ref, gaps, name)


@pytest.mark.parametrize("name", ["gptq-w4-g32-asym", "gptq-w8-g32-sym"])
def test_bf16_activations_stay_within_bf16_error(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="bfloat16", num_kv_blocks=32)
    hf = _hf(float_copies[name])
    for prompt, _ in reference(name):
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, :-1]
        diff = (folio_logits(llm, prompt) - theirs).abs().max().item()
        assert diff < 0.06 * theirs.abs().max().item()


def test_layers_keep_only_the_packed_form():
    llm = LLM(str(FIXTURES / "gptq-w4-g32-descact"), dtype="float32", num_kv_blocks=16)
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
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    prompts = [{"prompt_token_ids": p} for p, _ in reference(name)]
    one = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    expect = one.generate(prompts, params, use_tqdm=False)
    two = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
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


# --------------------------------------------------------------------------- bad input


def _copy(tmp_path, name="gptq-w4-g32-sym"):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_bits_and_options_are_refused_by_name(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, bits=3)
    with pytest.raises(ValueError, match="GPTQ with 3-bit weights is not supported; "
                                         "supported: 4, 8 bits"):
        LLM(str(folder), num_kv_blocks=16)
    _edit_config(folder, bits=4, lm_head=True)
    with pytest.raises(ValueError, match="quantized lm_head is not supported"):
        LLM(str(folder), num_kv_blocks=16)
    _edit_config(folder, lm_head=False, checkpoint_format="marlin")
    with pytest.raises(ValueError, match="checkpoint_format 'marlin' is not supported"):
        LLM(str(folder), num_kv_blocks=16)


def test_a_group_size_the_tensors_do_not_have_is_caught_at_load(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, group_size=64)
    with pytest.raises(ValueError, match=r"\.qzeros: checkpoint tensor of shape \(4, \d+\) "
                                         r"does not fit parameter of shape \(2, \d+\)"):
        LLM(str(folder), num_kv_blocks=16)
    _edit_config(folder, group_size=48)
    with pytest.raises(ValueError, match="group_size 48 does not divide the layer's 128 "
                                         "input features"):
        LLM(str(folder), num_kv_blocks=16)


def test_a_flag_that_names_another_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--quantization awq does not match the checkpoint, "
                                         "whose weights are gptq"):
        LLM(str(FIXTURES / "gptq-w4-g32-sym"), quantization="awq", num_kv_blocks=16)


def test_a_corrupt_group_index_is_caught_at_load(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _copy(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.g_idx"][5] = 9
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj: GPTQ g_idx holds groups outside 0..3"):
        LLM(str(folder), num_kv_blocks=16)


def test_a_truncated_checkpoint_is_caught_at_load(tmp_path):
    folder = _copy(tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200_000])
    with pytest.raises(Exception, match="(?i)safetensors|incomplete|truncat|invalid"):
        LLM(str(folder), num_kv_blocks=16)
