"""GGUF's Q4_0, Q4_1 and Q8_0 linear weights, kept in their blocks' codes.

A block is 32 consecutive input features of one output row: a float16 scale
d (and for Q4_1 a float16 min m) and 32 codes. Q4_0: w = (q - 8) d; Q4_1:
w = q d + m; Q8_0: w = q d with q a signed byte. The loader
(`model/gguf_loader.py`) splits each packed tensor into three checkpoint
tensors the layers' loader can shard like any other (rows are output
features; blocks run along the input):

- `qcodes` uint8 [out, in * bits / 8]: unsigned codes, for 4 bits two per
  byte, input feature 2j in the low nibble of byte j and 2j + 1 in the high
  one; Q8_0's signed bytes are offset by 128;
- `qscales` [out, in / 32]: d;
- `qoffsets` [out, in / 32]: -8 d, m, or -128 d.

So w = q * scale + offset for all three, exactly as the gguf package
dequantizes them (every product and sum there is exact in fp32). Which
tensors are kept packed is decided once, when the config is read
(`gguf_loader.packed_linear_tensors`: a fused layer's projections must share
one packable type); the others, K-quants among them, are dequantized to
float at load and run as plain weights. The embedding table (`token_embd`,
often Q8_0) is kept in its codes the same way: the embedding dequantizes the
rows it looks up and a tied LM head multiplies by the same packed form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from folio.model.layers.linear import PlainLinearMethod
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.int_groups import IntCheckpointMethod, IntGroups

BLOCK = 32
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# our fused projections -> the checkpoint projections they hold
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def shard_names(prefix: str) -> list[str]:
    """The checkpoint weights a layer named `prefix` is loaded from."""
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{part}.weight" for part in FUSED.get(leaf, (leaf,))]


@register_quantization("gguf")
class GGUFConfig(QuantizationConfig):
    """config: {"packed": {HF weight name: GGUF type}} for the tensors kept packed."""

    def __init__(self, config: dict[str, Any], *, weight_dtype=None):
        super().__init__(config, weight_dtype=weight_dtype)
        self.packed = dict(config.get("packed") or {})
        unknown = sorted(set(self.packed.values()) - set(BITS))
        if unknown:
            raise ValueError(f"GGUF tensor types {', '.join(unknown)} cannot run packed; "
                             f"packed: {', '.join(BITS)}")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        kinds = {self.packed.get(name) for name in shard_names(prefix)}
        if len(kinds) == 1 and None not in kinds:
            return GGUFLinearMethod(kinds.pop(), prefix)
        return PlainLinearMethod(self.weight_dtype)

    def get_embedding_method(self, layer: nn.Module, prefix: str):
        """`token_embd` (and an untied `output`) of a packable type: rows of
        the table are output features, its blocks run along the hidden size."""
        kind = self.packed.get(f"{prefix}.weight")
        return None if kind is None else GGUFLinearMethod(kind, prefix)


class GGUFLinearMethod(IntCheckpointMethod):
    """Offsets rather than zero points: its own `dequantize` and `int_groups`."""

    checkpoint_tensors = ("qcodes", "qscales", "qoffsets")

    def __init__(self, kind: str, prefix: str):
        self.kind, self.bits, self.prefix = kind, BITS[kind], prefix

    def create_weights(self, layer, in_features, out_features, dtype):
        if in_features % BLOCK:
            raise ValueError(f"{self.prefix}: {in_features} input features per rank do not "
                             f"split into GGUF's blocks of {BLOCK}")
        per_byte = 8 // self.bits
        weight_param(layer, "qcodes", (out_features, in_features // per_byte), torch.uint8,
                     output_dim=0, input_dim=1, packed_dim=1, pack_factor=per_byte)
        for name in ("qscales", "qoffsets"):
            weight_param(layer, name, (out_features, in_features // BLOCK), torch.float32,
                         output_dim=0, input_dim=1)

    def _codes(self, layer) -> torch.Tensor:
        c = layer.qcodes.data
        if self.bits == 4:
            c = torch.stack([c & 0xF, c >> 4], dim=-1).flatten(-2)
        return c

    def dequantize(self, layer) -> torch.Tensor:
        groups = torch.arange(self._codes(layer).shape[1]) // BLOCK
        return (self._codes(layer).float() * layer.qscales.data[:, groups]
                + layer.qoffsets.data[:, groups])

    def int_groups(self, layer) -> IntGroups:
        codes = self._codes(layer)
        groups = torch.arange(codes.shape[1]) // BLOCK
        return IntGroups.from_codes(codes, groups, layer.qscales.data, self.bits,
                                    offset=layer.qoffsets.data)
