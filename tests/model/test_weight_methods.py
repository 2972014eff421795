"""The weight-method seam: a format is a QuantizationConfig + LinearMethod
registered from outside the model (here, by the test alone), picked per layer,
and the layers' loader shards any method's tensors, packed ones included."""

import json

import pytest
import torch
import torch.nn.functional as F

from folio import LLM, SamplingParams
from folio.model.layers import linear as linear_mod
from folio.model.layers.quantization import (LinearMethod, QuantizationConfig,
                                             register_quantization)
from folio.model.layers.quantization.base import weight_param
from folio.distributed import parallel_state
from tests.utils import make_tiny_model


class TransposedMethod(LinearMethod):
    """Test-only: loads the checkpoint's [out, in] weight, keeps it as [in, out]
    once loaded, and multiplies with x @ W^T written as a plain matmul."""

    def create_weights(self, layer, in_features, out_features, dtype):
        weight_param(layer, "weight", (out_features, in_features), dtype,
                     output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer):
        layer.transposed = layer.weight.data.t().contiguous()
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

    def apply(self, layer, x, bias=None):
        out = x @ layer.transposed
        return out if bias is None else out + bias


@register_quantization("test-transposed")
class TransposedConfig(QuantizationConfig):
    prefixes: list = []

    def get_linear_method(self, layer, prefix):
        TransposedConfig.prefixes.append(prefix)
        return TransposedMethod()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])          # qwen2: biased qkv
def test_a_method_registered_by_a_test_runs_the_model_with_the_same_tokens(tmp_path, arch):
    folder = make_tiny_model(tmp_path, arch=arch)
    prompts = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    plain = LLM(folder, dtype="float32", num_kv_blocks=32)
    expected = [o.outputs[0] for o in plain.generate(prompts, params)]
    TransposedConfig.prefixes = []
    llm = LLM(folder, dtype="float32", num_kv_blocks=32, quantization="test-transposed")
    model = llm.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, linear_mod.LinearBase)]
    assert layers and all(isinstance(m.quant_method, TransposedMethod) for m in layers)
    assert all(m.weight.numel() == 0 and m.transposed.shape == (m.in_features, m.out_features)
               for m in layers)
    assert "model.layers.1.self_attn.qkv_proj" in TransposedConfig.prefixes
    assert "model.layers.0.mlp.down_proj" in TransposedConfig.prefixes
    assert model.model.native_decoder is None       # the one call cannot run this method
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        for da, db in zip(a.logprobs, b.logprobs):
            for token in db:
                assert abs(da[token] - db[token]) < 1e-4


class PackedInt4Method(LinearMethod):
    """Test-only: a GPTQ-shaped tensor, [in, out / 8] int32 (eight 4-bit output
    features per element), to check where the layers' loader puts its slices."""

    def create_weights(self, layer, in_features, out_features, dtype):
        weight_param(layer, "qweight", (in_features, out_features // 8), torch.int32,
                     output_dim=1, input_dim=0, packed_dim=1, pack_factor=8)
        weight_param(layer, "scale", (1,), torch.float32, output_dim=None, input_dim=None)


class PackedConfig(QuantizationConfig):
    def get_linear_method(self, layer, prefix):
        return PackedInt4Method()


@pytest.fixture
def rank_1_of_2():
    parallel_state.set_tensor_parallel(1, 2)
    yield
    parallel_state.set_tensor_parallel(0, 1)


def test_packed_tensors_shard_along_their_packed_axis(rank_1_of_2):
    packed = PackedConfig({})
    full = torch.arange(32 * 64 // 8, dtype=torch.int32).view(32, 8)      # 64 output features

    column = linear_mod.ColumnParallelLinear(32, 64, False, torch.float32, packed)
    column.qweight.weight_loader(column.qweight, full)
    assert torch.equal(column.qweight.data, full[:, 4:])           # rank 1: features 32..63

    row = linear_mod.RowParallelLinear(32, 64, False, torch.float32, packed)
    row.qweight.weight_loader(row.qweight, full)
    assert torch.equal(row.qweight.data, full[16:])                # rank 1: inputs 16..31

    merged = linear_mod.MergedColumnParallelLinear(32, [64, 64], False, torch.float32, packed)
    gate, up = full, full + 1000
    merged.qweight.weight_loader(merged.qweight, gate, 0)
    merged.qweight.weight_loader(merged.qweight, up, 1)
    # rank 1 keeps the second half of each: [gate 32..63 | up 32..63], in packed units
    assert torch.equal(merged.qweight.data, torch.cat([gate[:, 4:], up[:, 4:]], dim=1))
    merged.scale.weight_loader(merged.scale, torch.tensor([0.5]), 1)
    assert merged.scale.item() == 0.5                              # unsharded: copied whole

    qkv = linear_mod.QKVParallelLinear(32, 16, 4, 2, False, torch.float32, packed)
    q, k, v = (torch.full((32, 8), fill, dtype=torch.int32) for fill in (1, 2, 3))
    k[:, 2:] = 20                  # the second KV head's features (16..31 of 32)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        qkv.qweight.weight_loader(qkv.qweight, t, shard)
    # per rank: 2 q heads (32 features = 4 packed), 1 k head and 1 v head (2 packed each)
    assert qkv.qweight.shape == (32, 8)
    assert torch.equal(qkv.qweight.data[:, 4:6], torch.full((32, 2), 20, dtype=torch.int32))
    assert torch.equal(qkv.qweight.data[:, 6:], torch.full((32, 2), 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        column.qweight.weight_loader(column.qweight, full.float())


def test_a_checkpoint_format_that_is_not_supported_is_named(tmp_path):
    folder = make_tiny_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "HQQ", "nbits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization method 'hqq' is not supported"):
        LLM(folder, num_kv_blocks=16)
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        LLM(folder, num_kv_blocks=16, quantization="none")


def test_missing_weights_are_named_by_their_checkpoint_names(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = make_tiny_model(tmp_path)
    weights = load_file(f"{folder}/model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]     # q and v of the same fused layer stay
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for: \['model\.layers\.1\.self_attn"
                                         r"\.k_proj\.weight'\]"):
        LLM(folder, num_kv_blocks=16)


def test_the_plain_method_hands_a_bf16_layer_to_its_repack():
    layer = linear_mod.RowParallelLinear(64, 32, False, torch.bfloat16)
    layer.weight.data.normal_()
    x = torch.randn(3, 64).bfloat16()
    before = F.linear(x, layer.weight)
    layer.process_weights_after_loading()
    packed = linear_mod.pack_weight(torch.zeros(16, 16).bfloat16())
    if packed is None:
        assert isinstance(layer.quant_method, linear_mod.PlainLinearMethod)
    else:
        assert layer.quant_method is layer.packed and type(layer.packed) is type(packed)
    assert torch.allclose(layer(x).float(), before.float(), rtol=2 ** -7, atol=1e-2)


def test_a_quantization_config_without_its_method_is_refused(tmp_path):
    """A quantized checkpoint that does not say its format must not load as plain
    weights (its tensors would be packed integers read as floats)."""
    folder = make_tiny_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config has no quant_method"):
        LLM(folder, num_kv_blocks=16)
