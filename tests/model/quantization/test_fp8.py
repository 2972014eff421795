"""FP8 (e4m3) weights (issue 54): the CPU kernel (native/fp8linear.c) against
the dequantized product, compressed-tensors' float-quantized checkpoints made
by llm-compressor 0.14.0.1 (tests/fixtures/quant/ct-fp8-*, by
scripts/make_ct_fixtures.sh), and `--quantization fp8`.

References for the checkpoints:
- an exact float copy: w = e4m3(code) * scale (each scale spread over its
  channel, tensor or 128x128 block) by this test's own code, run by
  transformers in fp32. Folio runs fp8 weights weight-only (activations in
  the run's dtype), so its logits match that copy to fp32 rounding;
- the logits transformers gave when the fixture was made: compressed-tensors
  decompresses the weights and quantizes each layer's input to fp8 as the
  scheme says (dynamic per token, per group of 128, or the static
  input_scale). The float copy with those activations quantized by this
  test's code gives them back (to 1e-4), which checks that the copy reads
  the checkpoint as compressed-tensors does.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from folio import LLM, SamplingParams
from folio.kernels import native
from folio.model.layers.quantization import fp8
from tests.model.quantization.checkpoints import (
    FIXTURES, assert_greedy_tokens_equal, assert_logits_match, assert_tensor_parallel_2_matches,
    copy_fixture, edit_quantization_config, edit_tensors, float_model, folio_logits, hf_logits,
    reference, write_float_copy)
from tests.model.native_builds import cpu_has, x86

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

NAMES = ["ct-fp8-dynamic", "ct-fp8-static", "ct-fp8-block"]
E4M3_MAX = 448.0

needs_kernel = pytest.mark.skipif(not native.has_fp8_linear(),
                                  reason="no AVX2 + FMA + F16C on this machine (or no compiler): "
                                         "fp8 weights are dequantized per call")


def _builds():
    """This machine's build, and the AVX2 one where it differs."""
    yield pytest.param(None, id="native")
    if not x86() or native.distinct_build(("-mno-avx512f",)):
        yield pytest.param(("-mno-avx512f",), id="avx2", marks=pytest.mark.skipif(
            not x86() or not cpu_has("avx2", "fma", "f16c"),
            reason="the AVX2 build needs an x86-64 CPU with AVX2, FMA and F16C"))


@pytest.fixture(scope="module", params=list(_builds()))
def lib(request):
    if request.param is None:
        return native.load()
    return native._build(request.param)


def _random_fp8(n, k, blocks, seed=0):
    """Random finite e4m3 codes (every one of the 254, subnormals and both
    zeros included) and positive scales [n, blocks]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7f) == 0x7f] = 0x3c        # the NaNs (S.1111.111): none in a checkpoint
    scales = torch.rand(n, blocks, generator=g) * 0.02 + 1e-3
    return codes, scales


# --------------------------------------------------------------------------- the kernel


def test_every_code_decodes_to_its_e4m3_value(lib):
    """One input feature at a time, scale 1: the output is the code's value,
    exactly (subnormals, zeros and signs included)."""
    if not lib.folio_fp8_linear_available():
        pytest.skip("this build has no fp8 kernel")
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7f) != 0x7f].reshape(-1, 1)               # 254 rows, K = 1
    c, s = native.pack_fp8_linear(codes, torch.ones(len(codes), 1), 1)
    out = native.fp8_linear(torch.ones(1, 1), c, s, 1, len(codes), lib=lib)
    assert torch.equal(out[0], codes.view(torch.float8_e4m3fn).float()[:, 0])


@pytest.mark.parametrize("n,k,block", [(40, 96, 96), (13, 200, 64), (24, 256, 128),
                                       (7, 33, 16), (16, 130, 128)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_kernel_matches_the_dequantized_product(lib, n, k, block, rows):
    if not lib.folio_fp8_linear_available():
        pytest.skip("this build has no fp8 kernel")
    codes, scales = _random_fp8(n, k, -(-k // block))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    c, s = native.pack_fp8_linear(codes, scales, block)
    out = native.fp8_linear(x, c, s, block, n, bias, lib=lib)
    w = fp8.dequantize(codes, scales, block, torch.float64)
    ref = x.double() @ w.T + bias.double()
    assert out.shape == (rows, n)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(lib):
    """The same arithmetic at every row count (codes widened in registers or
    once into scratch): row r alone and among 1..20 rows, bit for bit."""
    if not lib.folio_fp8_linear_available():
        pytest.skip("this build has no fp8 kernel")
    n, k, block = 48, 320, 128
    codes, scales = _random_fp8(n, k, 3)
    c, s = native.pack_fp8_linear(codes, scales, block)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([native.fp8_linear(x[i:i + 1], c, s, block, n, lib=lib) for i in range(20)])
    for rows in (2, 4, 5, 9, 20):
        assert torch.equal(native.fp8_linear(x[:rows], c, s, block, n, lib=lib), alone[:rows])


@pytest.mark.skipif(not x86() or not native.distinct_build(("-mno-avx512f",))
                    or not cpu_has("avx2", "fma", "f16c") or not native.has_fp8_linear(),
                    reason="needs an AVX-512 machine that also runs the AVX2 build")
def test_the_avx512_and_avx2_builds_agree_bit_for_bit():
    """Each output's sums run in the same order in 16-float and 8-float
    registers: the two builds give the same bits."""
    n, k, block = 40, 300, 128
    codes, scales = _random_fp8(n, k, 3, seed=6)
    c, s = native.pack_fp8_linear(codes, scales, block)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7))
    avx2 = native._build(("-mno-avx512f",))
    for rows in (1, 9):
        assert torch.equal(native.fp8_linear(x[:rows], c, s, block, n),
                           native.fp8_linear(x[:rows], c, s, block, n, lib=avx2))


def test_packing_refuses_scales_of_another_shape():
    codes, scales = _random_fp8(8, 64, 2)
    with pytest.raises(ValueError, match=r"expected \[8, 1\]"):
        native.pack_fp8_linear(codes, scales, 64)


@needs_kernel
def test_the_layer_keeps_the_codes_and_gives_them_back():
    codes, scales = _random_fp8(20, 100, 1)
    layer = fp8.Fp8Linear(codes, scales, 100)
    assert layer.data.dtype == torch.uint8 and layer.data.numel() == 32 * 100   # tiles of 16
    assert torch.equal(layer.dequantize(), fp8.dequantize(codes, scales, 100))


# --------------------------------------------------------------------------- checkpoints


def _scheme(name):
    config = json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]
    return config["config_groups"]["group_0"]


def fp8_dequantize(tensors, prefix, kind):
    """The float weight of module `prefix` (w = e4m3 * its scale), plainly."""
    if kind != "weight" or tensors[f"{prefix}.weight"].dtype != torch.float8_e4m3fn:
        return None
    w = tensors[f"{prefix}.weight"].float()
    s = tensors[f"{prefix}.weight_scale"].float()
    if s.numel() == 1:                                                   # tensor
        return w * s.reshape(())
    if s.shape == (w.shape[0], 1):                                       # channel
        return w * s
    rows = -(-w.shape[0] // s.shape[0])                                  # blocks
    cols = -(-w.shape[1] // s.shape[1])
    full = s.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
    return w * full


@pytest.fixture(scope="module")
def float_copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {name: write_float_copy(name, fp8_dequantize, root / name) for name in NAMES}


def _prompts(name):
    return [prompt for prompt, _ in reference(name)]


def test_the_fixtures_are_what_the_readme_says():
    schemes = [_scheme(name) for name in NAMES]
    assert [(s["format"], s["weights"]["type"], s["weights"]["strategy"],
             s["input_activations"]["strategy"], s["input_activations"]["dynamic"])
            for s in schemes] == [("float-quantized", "float", "channel", "token", True),
                                  ("float-quantized", "float", "tensor", "tensor", False),
                                  ("float-quantized", "float", "block", "group", True)]
    assert schemes[2]["weights"]["block_structure"] == [128, 128]
    block = load_file(str(FIXTURES / "ct-fp8-block" / "model.safetensors"))
    prefix = "model.layers.0"
    assert block[f"{prefix}.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert block[f"{prefix}.mlp.gate_proj.weight_scale"].shape == (2, 1)
    assert block[f"{prefix}.mlp.down_proj.weight_scale"].shape == (1, 2)
    assert block[f"{prefix}.self_attn.k_proj.weight_scale"].shape == (1, 1)   # 64 rows
    static = load_file(str(FIXTURES / "ct-fp8-static" / "model.safetensors"))
    assert static[f"{prefix}.self_attn.q_proj.input_scale"].shape == (1,)


@pytest.mark.parametrize("name", NAMES)
def test_the_float_copy_with_fp8_activations_gives_the_tools_logits(name, float_copies):
    """transformers on this test's float copy, each quantized layer's input
    quantized to fp8 as the scheme says, reproduces the logits
    compressed-tensors' own decompression gave when the fixture was made."""
    acts = _scheme(name)["input_activations"]
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    hf = float_model(float_copies[name])

    def fake(x, s):
        return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s

    def hook_for(module):
        def hook(mod, args):
            x = args[0]
            if acts["strategy"] == "tensor":
                return (fake(x, tensors[f"{module}.input_scale"].float()),)
            if acts["strategy"] == "group":
                parts = x.unflatten(-1, (-1, acts["group_size"]))
                return (fake(parts, parts.abs().amax(-1, keepdim=True) / E4M3_MAX).flatten(-2),)
            return (fake(x, x.abs().amax(-1, keepdim=True) / E4M3_MAX),)
        return hook

    for module, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{module}.weight_scale" in tensors:
            mod.register_forward_pre_hook(hook_for(module))
    for prompt, logits in reference(name):
        assert (hf_logits(hf, prompt) - logits[:-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_exact_float_copy(name, kernel, float_copies, monkeypatch):
    if kernel and not native.has_fp8_linear():
        pytest.skip("no fp8 kernel on this machine")
    if not kernel:
        monkeypatch.setattr(native, "has_fp8_linear", lambda: False)
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_method, fp8.Fp8Linear)
    assert layer.quant_method.kernel == kernel
    assert layer.weight.numel() == 0 and layer.weight_scale.numel() == 0
    assert_logits_match(llm, float_model(float_copies[name]), _prompts(name), 2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_exact_weights(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    assert_greedy_tokens_equal(llm, float_model(float_copies[name]), _prompts(name), name)


def test_bf16_activations_stay_within_bf16_error(float_copies):
    from tests.model.quantization.checkpoints import assert_within_bf16_error
    llm = LLM(str(FIXTURES / "ct-fp8-block"), dtype="bfloat16", num_kv_blocks=32)
    assert_within_bf16_error(llm, float_model(float_copies["ct-fp8-block"]),
                             _prompts("ct-fp8-block"), 0.06)


@pytest.mark.parametrize("name", ["ct-fp8-dynamic", "ct-fp8-static"])
def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs(name):
    """Column-parallel layers split the codes and the scales spread over their
    rows (a tensor scale per fused shard); row-parallel ones split the codes'
    inputs and keep each row's one scale whole."""
    assert_tensor_parallel_2_matches(FIXTURES / name, _prompts(name))


def test_row_parallel_ranks_must_get_whole_blocks():
    """128x128 blocks: o_proj's 128 inputs over 2 ranks are 64 each, half a
    block, refused naming the layer (a rank's scales would cover inputs it
    does not hold)."""
    with pytest.raises(ValueError, match="o_proj: compressed-tensors fp8 blocks of 128 input "
                                         "features: each of the 2 tensor-parallel ranks gets "
                                         "64 of the layer's 128, not whole blocks"):
        LLM(str(FIXTURES / "ct-fp8-block"), dtype="float32", num_kv_blocks=16,
            tensor_parallel_size=2)


def test_block_scales_split_with_whole_blocks_under_tensor_parallelism(tmp_path):
    """Blocks of 128 rows and 64 inputs: every row-parallel rank holds whole
    blocks (o_proj 64 of 128 inputs, down_proj 128 of 256), so tensor
    parallelism 2 gives size 1's tokens and logprobs."""
    folder = copy_fixture(tmp_path, "ct-fp8-block")

    def blocks_of_64(config):
        config["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 64]
    edit_quantization_config(folder, blocks_of_64)

    def split_scales(tensors):
        for key in [k for k in tensors if k.endswith(".weight_scale")]:
            tensors[key] = tensors[key].repeat_interleave(2, dim=1)[:, :-(-tensors[
                key.replace("weight_scale", "weight")].shape[1] // 64)].contiguous()
    edit_tensors(folder, split_scales)
    assert_tensor_parallel_2_matches(folder, _prompts("ct-fp8-block"))


@pytest.mark.parametrize("edit,message", [
    (lambda g: g["weights"].update(num_bits=4), "float-quantized weights of type 'float', 4 bits"),
    (lambda g: g["weights"].update(strategy="group", group_size=32), "strategy 'group'"),
    (lambda g: g["weights"].update(symmetric=False), "must be symmetric and static"),
    (lambda g: g["input_activations"].update(type="int"), "'int' 8-bit input activations"),
    (lambda g: g.update(output_activations={"num_bits": 8, "type": "float"}),
     "output activation quantization"),
    (lambda g: g["weights"].update(block_structure=[128]), "block_structure"),
])
def test_unsupported_fp8_schemes_are_refused_by_name(edit, message, tmp_path):
    folder = copy_fixture(tmp_path, "ct-fp8-block")
    edit_quantization_config(folder, lambda config: edit(config["config_groups"]["group_0"]))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight_scale": torch.ones(3, 1)}),
     r"blocks of 128x128 over \[256, 128\] are \[2, 1\]"),
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight":
                         t["model.layers.0.mlp.gate_proj.weight"].float()}),
     "stored as torch.float32; expected float8_e4m3fn"),
])
def test_tensors_that_do_not_fit_the_scheme_are_caught_at_load(edit, message, tmp_path):
    folder = copy_fixture(tmp_path, "ct-fp8-block")
    edit_tensors(folder, edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_a_static_input_scale_that_is_not_positive_and_finite_is_refused(bad, tmp_path):
    """Activations are divided by the static scale: 0 would make them all
    infinite (NaN logits on the fp8-products path), so the load refuses it."""
    folder = copy_fixture(tmp_path, "ct-fp8-static")
    key = "model.layers.0.self_attn.k_proj.input_scale"
    edit_tensors(folder, lambda t: t.update({key: torch.tensor([bad])}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.(k_proj|qkv_proj): "
                       r"compressed-tensors input_scale \[.*\]: a static activation scale is "
                       "one positive, finite value"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


# --------------------------------------------------------------------------- --quantization fp8


def test_quantize_rounds_each_weight_to_the_nearest_code_of_its_rows_scale():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 150, generator=g) * torch.rand(37, 1, generator=g)
    w[5] = 0
    codes, scales = fp8.quantize(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (37, 1)
    assert torch.equal(scales[5], torch.ones(1)) and (codes[5].float() == 0).all()
    # the largest weight of each row takes the largest code
    rows = torch.arange(37) != 5
    assert (codes[rows].float().abs().amax(1) == E4M3_MAX).all()
    back = codes.float() * scales
    # within half an e4m3 step (3 mantissa bits: 2^-4 relative) of the weight
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + scales * 2 ** -10).all()


def _servable_float_copy(name, out):
    """The exact float copy with the fixture's tokenizer beside it: a folder
    Folio serves."""
    import shutil
    folder = write_float_copy(name, fp8_dequantize, out)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURES / name / file, folder / file)
    return folder


def test_quantization_fp8_on_a_float_checkpoint(tmp_path):
    """Every decoder projection in e4m3 with per-channel scales (the
    embeddings and LM head float); its logits as close to the float model's
    as int8's per-channel codes are, and greedy tokens from it."""
    float_folder = _servable_float_copy("ct-fp8-dynamic", tmp_path / "float")
    prompts = _prompts("ct-fp8-dynamic")
    plain = LLM(str(float_folder), dtype="float32", num_kv_blocks=32)
    fp8_llm = LLM(str(float_folder), dtype="float32", num_kv_blocks=32, quantization="fp8")
    layer = fp8_llm.engine.executor.runner.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.quant_method, fp8.Fp8Linear) and layer.weight.numel() == 0
    for prompt in prompts:
        exact = folio_logits(plain, prompt)
        ours = folio_logits(fp8_llm, prompt)
        assert (ours - exact).abs().max().item() < 0.05 * exact.abs().max().item()
    out = fp8_llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_quantization_fp8_product_is_the_dequantized_one():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    codes, scales = fp8.quantize(w)
    layer = fp8.Fp8Linear(codes, scales, 96)
    x = torch.randn(3, 96)
    ref = F.linear(x.double(), fp8.dequantize(codes, scales, 96, torch.float64))
    assert torch.allclose(layer(x, None).double(), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- MoE

MOE = "ct-qwen3moe-fp8-dynamic"


@pytest.fixture(scope="module")
def moe_float_model(tmp_path_factory):
    """transformers' fp32 model of the MoE fixture's exact float copy, every
    tensor read (none missing, none left over)."""
    from transformers import AutoModelForCausalLM
    folder = write_float_copy(MOE, fp8_dequantize, tmp_path_factory.mktemp("moe") / MOE)
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_moe_experts_stay_fp8_and_match_the_exact_float_copy(kernel, moe_float_model,
                                                               monkeypatch):
    """Every expert's matrices load through the fp8 method and are held as
    Fp8Linear (codes, never floats); the logits are the float copy's. (The
    fixture's own reference is not: transformers ran its experts merged in
    bf16, their inputs not quantized, README.md there.)"""
    from folio.model.layers.moe import FusedMoE
    if kernel and not native.has_fp8_linear():
        pytest.skip("no fp8 kernel on this machine")
    if not kernel:
        monkeypatch.setattr(native, "has_fp8_linear", lambda: False)
    llm = LLM(str(FIXTURES / MOE), dtype="float32", num_kv_blocks=32)
    moes = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2
    for moe in moes:
        assert len(moe.packed_experts) == 4
        for pair in moe.packed_experts:
            assert all(isinstance(m, fp8.Fp8Linear) and m.kernel == kernel for m in pair)
    assert_logits_match(llm, moe_float_model, _prompts(MOE), 2e-4)
    assert_greedy_tokens_equal(llm, moe_float_model, _prompts(MOE), MOE)


def test_moe_tensor_parallel_2_gives_the_same_tokens_and_logprobs():
    """Every expert's gate and up split along the output with their channel
    scales, its down along the input (each row's one scale whole)."""
    assert_tensor_parallel_2_matches(FIXTURES / MOE, _prompts(MOE))


def test_quantization_fp8_quantizes_float_experts(tmp_path, moe_float_model):
    """-q fp8 on a float MoE checkpoint: the experts in e4m3 too."""
    from folio.model.layers.moe import FusedMoE
    folder = _servable_float_copy(MOE, tmp_path / "float")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, quantization="fp8")
    moe = next(m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE))
    assert all(isinstance(m, fp8.Fp8Linear) for pair in moe.packed_experts for m in pair)
    for prompt in _prompts(MOE):
        theirs = hf_logits(moe_float_model, prompt)
        assert (folio_logits(llm, prompt) - theirs).abs().max().item() \
            < 0.05 * theirs.abs().max().item()


# --------------------------------------------------------------------------- fp8 products


@pytest.mark.parametrize("name", ["ct-fp8-dynamic", "ct-fp8-static"])
def test_fp8_products_give_the_tools_own_logits(name, monkeypatch):
    """The path a GPU with fp8 products takes (`torch._scaled_mm`, which torch
    also runs on the CPU): each layer's input quantized to e4m3 as the
    checkpoint declares (per token, or its static input_scale), so the logits
    are those compressed-tensors' own decompression gave, activations
    quantized, when the fixture was made."""
    monkeypatch.setattr(fp8, "fp8_products", lambda device: True)
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=32)
    model = llm.engine.executor.runner.model
    layers = [layer.self_attn.qkv_proj for layer in model.model.layers]
    assert all(layer.quant_method.products and not layer.quant_method.kernel
               for layer in layers)
    static = layers[0].quant_method.input_scale
    assert (static is not None) == (name == "ct-fp8-static")
    for prompt, logits in reference(name):
        ref = logits[:-1]
        ours = folio_logits(llm, prompt)
        assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_block_scales_take_the_weight_only_path_even_with_fp8_products(monkeypatch):
    """_scaled_mm's row scales do not take 128x128 blocks: those layers stay
    weight-only (the CPU kernel here)."""
    monkeypatch.setattr(fp8, "fp8_products", lambda device: True)
    llm = LLM(str(FIXTURES / "ct-fp8-block"), dtype="float32", num_kv_blocks=16)
    layer = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj
    assert not layer.quant_method.products


def test_quantize_rows_is_compressed_tensors_fake_quantization():
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(5)) * 3
    x[2] = 0
    q, s = fp8.quantize_rows(x)
    assert s.shape == (5, 1) and s[2].item() == 1.0
    assert (q.float().abs().amax(1)[[0, 1, 3, 4]] == E4M3_MAX).all()
    expect = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))
    q2, s2 = fp8.quantize_rows(x, torch.tensor([0.005]))
    assert torch.equal(s2, torch.full((5, 1), 0.005))
    assert q2.float().abs().max().item() == E4M3_MAX            # clamped


def test_quantization_fp8_holds_a_layer_in_float_only_while_it_loads(tmp_path, monkeypatch):
    """-q fp8 allocates a layer's float weight when its first checkpoint
    tensor arrives and quantizes it (dropping the float) when its last does:
    in the checkpoint's order at most two of the 8 projections are in float
    at once (q, k and v's fused layer may wait on o's tensor between them),
    never the model."""
    live, peak, done = set(), [0], []
    original = fp8.Fp8RTNMethod._load

    def load(self, layer, param, loaded, shard_id=None):
        original(self, layer, param, loaded, shard_id)
        (live.add if param.numel() else live.discard)(id(self))
        peak[0] = max(peak[0], len(live))
        if self.ready is not None:
            done.append(self.prefix)
    monkeypatch.setattr(fp8.Fp8RTNMethod, "_load", load)
    folder = _servable_float_copy("ct-fp8-dynamic", tmp_path / "float")
    LLM(str(folder), dtype="float32", num_kv_blocks=16, quantization="fp8")
    assert len(done) == 8 and not live and 1 <= peak[0] <= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs fp8 checkpoints on CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_fp8_checkpoints_on_the_gpu(name, float_copies):
    """On a card: channel and tensor scales as fp8 products where it has them
    (compute capability 8.9 and up: the tool's own logits, activations
    quantized), else and for block scales the Triton kernel (weight-only: the
    exact float copy's logits); within bf16's rounding of the products'
    output."""
    llm = LLM(str(FIXTURES / name), dtype="float32", device="cuda", max_model_len=256)
    method = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj.quant_method
    products = fp8.fp8_products(torch.device("cuda")) and name != "ct-fp8-block"
    assert method.products == products and method.triton == (not products)
    hf = None if products else float_model(float_copies[name])
    for prompt, logits in reference(name):
        ref = logits[:-1] if products else hf_logits(hf, prompt)
        ours = folio_logits(llm, prompt)
        assert (ours - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
