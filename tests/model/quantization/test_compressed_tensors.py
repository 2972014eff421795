"""compressed-tensors `pack-quantized` checkpoints made by llm-compressor
0.14.0.1 (compressed-tensors 0.19.0; tests/fixtures/quant): 4-bit groups of 32
symmetric and asymmetric, 8-bit per output channel.

Two references:
- an exact float copy: the format's formula w = (u - u_zero) * scale on the
  stored (offset, unsigned) codes, unpacked by this test's own code, run by
  transformers in fp32. Folio's packed layers match it to fp32 rounding (atol
  2e-4 on logits of magnitude ~8), and its greedy tokens equal transformers'
  on it;
- the logits transformers gave when the fixture was made. transformers
  decompresses these checkpoints to float32 itself, so those logits are the
  exact float copy's (README.md there; this test's formula reproduces them to
  the bit): the tolerance against them is the same 2e-4, and the same top
  token everywhere.
"""

import importlib.util
import json
import re

import pytest
import torch

from folio import LLM, SamplingParams
from tests.model.quantization.checkpoints import (
    FIXTURES, FP32, assert_greedy_tokens_equal, assert_logits_match, assert_tensor_parallel_2_matches,
    assert_within_bf16_error, copy_fixture, edit_quantization_config, edit_tensors, float_model,
    folio_logits, kernel_or_torch, reference, unpack, use_kernel, write_float_copy)

NAMES = ["ct-w4a16-g32", "ct-w4a16-asym-g32", "ct-w8a16-channel"]
G32 = "ct-w4a16-g32"        # the one the edited copies start from


def _weights_scheme(name):
    config = json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]
    return config["config_groups"]["group_0"]["weights"]


def ct_dequantize(tensors, prefix, bits):
    """The float weight [out, in] of module `prefix`, from its stored tensors."""
    out, inn = tensors[f"{prefix}.weight_shape"].tolist()
    u = unpack(tensors[f"{prefix}.weight_packed"], bits, 1)[:, :inn].float()   # q + 2^(b-1)
    scale = tensors[f"{prefix}.weight_scale"].float()                          # [out, groups]
    if f"{prefix}.weight_zero_point" in tensors:                               # zp + 2^(b-1)
        zero = unpack(tensors[f"{prefix}.weight_zero_point"], bits, 0)[:out].float()
    else:
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    g = torch.arange(inn) // (inn // scale.shape[1])
    return (u - zero[:, g]) * scale[:, g]


def ct_formula(bits):
    def dequantize(tensors, prefix, kind):
        return ct_dequantize(tensors, prefix, bits) if kind == "weight_packed" else None
    return dequantize


@pytest.fixture(scope="module")
def float_copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {name: write_float_copy(name, ct_formula(_weights_scheme(name)["num_bits"]),
                                   root / name)
            for name in NAMES}


def _prompts(name):
    return [prompt for prompt, _ in reference(name)]


def test_the_fixtures_are_what_the_readme_says():
    from safetensors.torch import load_file
    schemes = [_weights_scheme(name) for name in NAMES]
    assert [(s["num_bits"], s["strategy"], s["group_size"], s["symmetric"]) for s in schemes] \
        == [(4, "group", 32, True), (4, "group", 32, False), (8, "channel", None, True)]
    asym = load_file(str(FIXTURES / "ct-w4a16-asym-g32" / "model.safetensors"))
    prefix = "model.layers.0.mlp.gate_proj"
    assert asym[f"{prefix}.weight_packed"].shape == (256, 128 // 8)
    assert asym[f"{prefix}.weight_zero_point"].shape == (256 // 8, 128 // 32)   # packed on out
    assert asym[f"{prefix}.weight_shape"].tolist() == [256, 128]
    channel = load_file(str(FIXTURES / "ct-w8a16-channel" / "model.safetensors"))
    assert channel[f"{prefix}.weight_scale"].shape == (256, 1)
    assert f"{prefix}.weight_zero_point" not in channel


@kernel_or_torch
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_exact_float_copy(name, kernel, float_copies, monkeypatch):
    use_kernel(kernel, monkeypatch)
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_logits_match(llm, float_model(float_copies[name]), _prompts(name), 2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_tools_reference(name):
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    for prompt, logits in reference(name):
        ref = logits[:-1]
        ours = folio_logits(llm, prompt)
        assert (ours - ref).abs().max().item() < 2e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_exact_weights(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32)
    assert_greedy_tokens_equal(llm, float_model(float_copies[name]), _prompts(name), name)


@pytest.mark.parametrize("name", ["ct-w4a16-asym-g32", "ct-w8a16-channel"])
def test_bf16_activations_stay_within_bf16_error(name, float_copies):
    llm = LLM(str(FIXTURES / name), dtype="bfloat16", **FP32, num_kv_blocks=32)
    assert_within_bf16_error(llm, float_model(float_copies[name]), _prompts(name), 0.06)


def test_layers_keep_only_the_packed_form():
    llm = LLM(str(FIXTURES / "ct-w4a16-asym-g32"), dtype="float32", **FP32, num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    layer = model.model.layers[0].self_attn.qkv_proj
    for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
        assert getattr(layer, name).numel() == 0
    w = layer.quant_method.weights
    assert (w.bits, w.out_features, w.in_features) == (4, 256, 128)
    assert w.perm is None and w.zeros
    assert w.codes.numel() == 256 * 128 // 2


@pytest.mark.parametrize("name", ["ct-w4a16-asym-g32", "ct-w8a16-channel"])
def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs(name):
    """Column-parallel layers split weight_packed, the scales and the zero
    points (packed along the output: in whole words) along the output;
    row-parallel ones split weight_packed's words and the groups of the
    scales and zero points, and keep a channel scheme's one scale column
    whole. weight_shape holds full sizes on every rank."""
    assert_tensor_parallel_2_matches(FIXTURES / name, _prompts(name))


# --------------------------------------------------------------------------- ignore


def _edit_weights(folder, **values):
    edit_quantization_config(
        folder, lambda qc: qc["config_groups"]["group_0"]["weights"].update(values))


@pytest.mark.parametrize("entry", ["model.layers.1.mlp.down_proj",
                                   r"re:.*layers\.1\.mlp\.down_proj$"])
def test_an_ignored_decoder_layer_stays_plain(entry, tmp_path, float_copies):
    """A layer named in `ignore` (by name or regex) is stored as a float weight
    and runs as one."""
    folder = copy_fixture(tmp_path, G32)
    prefix = "model.layers.1.mlp.down_proj"

    def to_float(tensors):
        # float32: a bf16 scale times a code needs more than bf16's 8 bits
        tensors[f"{prefix}.weight"] = ct_dequantize(tensors, prefix, 4)
        for kind in ("weight_packed", "weight_scale", "weight_shape"):
            del tensors[f"{prefix}.{kind}"]
    edit_tensors(folder, to_float)
    edit_quantization_config(folder, lambda qc: qc["ignore"].append(entry))
    llm = LLM(str(folder), dtype="float32", **FP32, num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    plain = model.model.layers[1].mlp.down_proj
    assert hasattr(plain, "weight") and not hasattr(plain, "weight_packed")
    assert hasattr(model.model.layers[0].mlp.down_proj, "weight_packed")
    assert_logits_match(llm, float_model(float_copies[G32]), _prompts(G32), 2e-4)


def test_a_fused_layer_half_ignored_is_refused(tmp_path):
    folder = copy_fixture(tmp_path, G32)
    edit_quantization_config(folder, lambda qc: qc["ignore"].append(r"re:.*\.q_proj$"))
    with pytest.raises(ValueError, match=r"qkv_proj: compressed-tensors gives the projections "
                                         r"of this fused layer different schemes"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


# --------------------------------------------------------------------------- bad input


def test_unsupported_schemes_are_refused_by_name(tmp_path):
    folder = copy_fixture(tmp_path, G32)
    cases = [
        (dict(num_bits=2), "compressed-tensors with 2-bit weights .* is not supported; "
                           "supported: 4, 8 bits"),
        (dict(type="float"), "compressed-tensors 'float' weights .* are not supported; "
                             "supported: int"),
        (dict(strategy="tensor"), "compressed-tensors strategy 'tensor' .* is not supported; "
                                  "supported: group, channel"),
        (dict(actorder="group"), "compressed-tensors actorder 'group' .* is not supported"),
    ]
    original = _weights_scheme(G32)
    for change, message in cases:
        _edit_weights(folder, **{**original, **change})
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), **FP32, num_kv_blocks=16)
    _edit_weights(folder, **original)

    def activations(qc):
        qc["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    edit_quantization_config(folder, activations)
    with pytest.raises(ValueError, match=r"activation quantization \(compressed-tensors "
                                         r"config_groups\.group_0\.input_activations\) is not "
                                         r"supported"):
        LLM(str(folder), **FP32, num_kv_blocks=16)

    def other_format(qc):
        qc["config_groups"]["group_0"]["input_activations"] = None
        qc["format"] = qc["config_groups"]["group_0"]["format"] = "marlin-24"
    edit_quantization_config(folder, other_format)
    with pytest.raises(ValueError, match="compressed-tensors format 'marlin-24' .* is not "
                                         "supported; supported: pack-quantized"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_a_group_size_the_tensors_do_not_have_is_caught_at_load(tmp_path):
    folder = copy_fixture(tmp_path, G32)
    _edit_weights(folder, group_size=64)
    with pytest.raises(ValueError, match=r"\.weight_scale: checkpoint tensor of shape "
                                         r"\(\d+, 4\) does not fit parameter of shape \(\d+, 2\)"):
        LLM(str(folder), **FP32, num_kv_blocks=16)
    _edit_weights(folder, group_size=48)
    with pytest.raises(ValueError, match="compressed-tensors group_size 48 does not divide the "
                                         "layer's 128 input features"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


@pytest.mark.parametrize("shape, expected", [([64, 96], [64, 128]),
                                             ([128, 128], [64, 128])])
def test_a_weight_shape_that_is_not_the_layers_is_caught_at_load(shape, expected, tmp_path):
    """Checked per shard: k_proj's [128, 128] is q_proj's shape, the right
    input size but not k's output size."""
    folder = copy_fixture(tmp_path, G32)
    name = "model.layers.1.self_attn.k_proj.weight_shape"

    def edit(tensors):
        tensors[name] = torch.tensor(shape, dtype=torch.int64)
    edit_tensors(folder, edit)
    message = (f"{name}: compressed-tensors weight_shape {shape} does not match the "
               f"layer's {expected}")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(folder), **FP32, num_kv_blocks=16)


def test_row_parallel_ranks_must_get_whole_groups():
    """Groups of 128 at tensor-parallel size 2: a row-parallel layer of 128
    inputs gets half a group a rank (refused); a channel scheme's one group
    stays whole on every rank. Built as layers at rank 0 of 2 (no engine)."""
    from folio.distributed.parallel_state import set_tensor_parallel
    from folio.model.layers.linear import RowParallelLinear
    from folio.model.layers.quantization import get_quantization_config

    def config(**weights):
        scheme = {"num_bits": 4, "type": "int", "symmetric": False, **weights}
        return get_quantization_config("compressed-tensors", {
            "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme}}})
    set_tensor_parallel(0, 2)
    try:
        with pytest.raises(ValueError, match="o_proj: compressed-tensors group_size 128: each "
                                             "of the 2 tensor-parallel ranks gets 64 of the "
                                             "layer's 128 input features, not whole groups"):
            RowParallelLinear(128, 128, False, torch.float32,
                              config(strategy="group", group_size=128), "model.layers.0.o_proj")
        layer = RowParallelLinear(128, 128, False, torch.float32, config(strategy="channel"),
                                  "model.layers.0.o_proj")
        assert layer.weight_packed.shape == (128, 64 // 8)
        assert layer.weight_scale.shape == (128, 1) and layer.weight_scale.input_dim is None
        assert layer.weight_zero_point.shape == (128 // 8, 1)
    finally:
        set_tensor_parallel(0, 1)


def test_a_flag_that_names_another_format_is_refused():
    with pytest.raises(ValueError, match="--quantization awq does not match the checkpoint, "
                                         "whose weights are compressed-tensors"):
        LLM(str(FIXTURES / G32), quantization="awq", **FP32, num_kv_blocks=16)


KV = "ct-w8a16-kv-fp8"      # calibrated with a kv_cache_scheme: static fp8 scales a layer
KV_HEAD = "ct-w8a16-kv-fp8-head"    # the same, a scale per KV head (strategy attn_head)


@pytest.mark.parametrize("name", [KV, KV_HEAD])
def test_static_fp8_kv_scales_give_the_tools_reference(name):
    """llm-compressor's kv_cache_scheme (fp8, static, per tensor or per KV
    head): each layer's k_scale and v_scale. With --kv-cache-dtype fp8 every
    row written carries its head's scale from the checkpoint and the logits
    are transformers' on the same checkpoint (which quantizes keys and values
    the same way) to 1e-4; a float or int8 cache ignores the scales, and its
    logits then differ."""
    from safetensors.torch import load_file

    from folio.model.attention import kv_quant
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    llm = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32,
              kv_cache_dtype="fp8")
    for prompt, logits in reference(name):
        ref = logits[:-1]
        ours = folio_logits(llm, prompt)
        assert (ours - ref).abs().max().item() < 1e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    caches = llm.engine.executor.runner.kv_caches
    for i, cache in enumerate(caches):
        written = kv_quant.scales(cache[:, 0, :8])[..., 0]    # block 0's 8 rows [2, 8, Hkv]
        for kv, which in ((0, "k_scale"), (1, "v_scale")):
            want = tensors[f"model.layers.{i}.self_attn.{which}"].float().reshape(-1)
            assert torch.equal(written[kv], want.expand(8, cache.shape[3])), (i, which)
    if name == KV_HEAD:         # the heads' scales differ: each row took its own head's
        assert not torch.equal(*tensors["model.layers.0.self_attn.k_scale"].flatten()[:2])
    for other in ("auto", "int8"):
        plain = LLM(str(FIXTURES / name), dtype="float32", **FP32, num_kv_blocks=32,
                    kv_cache_dtype=other)
        prompt, logits = reference(name)[0]
        assert (folio_logits(plain, prompt) - logits[:-1]).abs().max().item() > 0.1


def test_per_head_kv_scales_split_with_the_kv_heads_under_tensor_parallelism():
    """TP 2 over the fixture's 2 KV heads: each rank writes its head's scale;
    the tokens are one rank's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p, _ in reference(KV_HEAD)]
    one = LLM(str(FIXTURES / KV_HEAD), dtype="float32", **FP32, num_kv_blocks=32,
              kv_cache_dtype="fp8")
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    two = LLM(str(FIXTURES / KV_HEAD), dtype="float32", **FP32, num_kv_blocks=32,
              kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == expected
        scales = two.engine.executor.runner.model.model.layers[0].self_attn.attn.kv_scales
        assert scales[0].shape == (1,)              # rank 0: its one KV head's
    finally:
        two.shutdown()


def test_other_kv_cache_schemes_are_refused_by_name(tmp_path):
    folder = copy_fixture(tmp_path, KV)

    def per_channel(qc):
        qc["kv_cache_scheme"]["strategy"] = "channel"
    edit_quantization_config(folder, per_channel)
    with pytest.raises(ValueError, match=r"kv_cache_scheme \('float', 8, 'channel'\) "
                                         r"\(dynamic: False\) is not supported: only static "
                                         r"fp8 scales per tensor or per attention head"):
        LLM(str(folder), **FP32, num_kv_blocks=16)


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "CPU_NATIVE", pytest.param(
    "TRITON", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                       reason="triton is not installed"))])
def test_per_head_kv_scales_in_every_backend(backend):
    """Each backend writes the rows with their head's scale (TRITON: in its
    interpreter here): the prompt's logits are the tool's reference."""
    llm = LLM(str(FIXTURES / KV_HEAD), dtype="float32", **FP32, num_kv_blocks=32,
              kv_cache_dtype="fp8", attention_backend=backend)
    prompt, logits = reference(KV_HEAD)[0]
    assert (folio_logits(llm, prompt) - logits[:-1]).abs().max().item() < 1e-4
