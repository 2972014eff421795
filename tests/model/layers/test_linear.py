"""Linear layers: the oneDNN-packed bf16 weights give exactly F.linear's result."""

import pytest
import torch
import torch.nn.functional as F

from folio.model.layers.linear import (MergedColumnParallelLinear, RowParallelLinear, linear,
                                       pack_weight, prepack)

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_is_bit_identical(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = pack_weight(w)
    assert packed is not None
    assert torch.equal(linear(x, w, packed, b), F.linear(x, w, b))


def test_only_bf16_on_cpu_is_packed():
    assert pack_weight(torch.randn(8, 8)) is None                       # fp32: MKL, unchanged
    assert pack_weight(torch.randn(8, 8).half()) is None


@needs_onednn
def test_prepacked_layers_answer_as_before_and_drop_the_plain_weight():
    torch.manual_seed(0)
    mlp = torch.nn.ModuleDict({
        "up": MergedColumnParallelLinear(64, [32, 32], False, torch.bfloat16),
        "down": RowParallelLinear(32, 64, True, torch.bfloat16)})
    for layer in mlp.values():
        layer.weight.data.normal_()
        if layer.bias is not None:
            layer.bias.data.normal_()
    x = torch.randn(7, 64).bfloat16()
    before = mlp["down"](mlp["up"](x)[:, :32])
    prepack(mlp)
    assert all(layer.packed is not None and layer.weight.numel() == 0 for layer in mlp.values())
    assert torch.equal(mlp["down"](mlp["up"](x)[:, :32]), before)
