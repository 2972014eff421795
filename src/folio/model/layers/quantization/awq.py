"""AWQ checkpoints, GEMM layout (what AutoAWQ and GPTQModel write).

Tensors of a quantized linear layer, as stored:
- `qweight` int32 [in, out / 8]: the 4-bit codes packed along the OUTPUT
  axis in AWQ's interleaved order: nibble i (bits 4i..4i+3) of word j holds
  output feature 8j + [0, 2, 4, 6, 1, 3, 5, 7][i];
- `qzeros` int32 [groups, out / 8]: the zero points, packed the same way and
  stored as they are (no GPTQ-style "zero - 1");
- `scales` [groups, out] (float16 or bfloat16).

w[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n].
4 bits only; any group size dividing the input features, or -1 (one group);
no act-order (AWQ has no g_idx). `zero_point: false` (symmetric) uses the
zero 8 whatever qzeros holds.

AWQ folds its smoothing scales into the preceding norms' weights, which the
checkpoint stores already folded: nothing here deals with them.

Tensor parallelism shards all three along the output for a column-parallel
layer (in whole words of 8 features), and for a row-parallel one qweight's
rows and the groups of qzeros and scales, which needs every rank's inputs to
be whole groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from folio.distributed.parallel_state import tp_size
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.int_checkpoint import (IntCheckpointMethod, check_input_groups,
                                                        check_packs, unpack_int32)

_BITS = (4,)
# the output feature (within its word's 8) of the code in the word's i-th nibble
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@register_quantization("awq")
class AWQConfig(QuantizationConfig):
    def __init__(self, config: dict[str, Any], *, weight_dtype=None):
        super().__init__(config, weight_dtype=weight_dtype)
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        if self.bits not in _BITS:
            raise ValueError(f"AWQ with {self.bits}-bit weights is not supported; supported: "
                             f"{', '.join(map(str, _BITS))} bits")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"AWQ group_size {self.group_size} is not valid (a positive "
                             "number, or -1 for one group)")
        self.zero_point = bool(config.get("zero_point", True))
        # AutoAWQ names the layout `version`, GPTQModel also `format`
        for key in ("version", "format", "checkpoint_format"):
            version = str(config.get(key) or "gemm").lower()
            if version != "gemm":
                raise ValueError(f"AWQ {key} {version!r} is not supported; supported: gemm")
        if config.get("lm_head"):
            raise ValueError("AWQ with a quantized lm_head is not supported (the decoder's "
                             "linear layers are)")
        if config.get("desc_act"):
            raise ValueError("AWQ with act-order (desc_act) is not supported")
        if config.get("modules_to_not_convert"):
            raise ValueError("AWQ with unquantized modules (`modules_to_not_convert`: "
                             f"{config['modules_to_not_convert']}) is not supported")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return AWQLinearMethod(self, prefix)


class AWQLinearMethod(IntCheckpointMethod):
    checkpoint_tensors = ("qweight", "qzeros", "scales")

    def __init__(self, config: AWQConfig, prefix: str):
        self.config, self.prefix, self.bits = config, prefix, config.bits

    def create_weights(self, layer, in_features, out_features, dtype):
        per = 32 // self.bits
        row_parallel = getattr(layer, "input_is_parallel", False)
        full_in = in_features * (tp_size() if row_parallel else 1)
        group = self.config.group_size if self.config.group_size != -1 else full_in
        where = f"{self.prefix}: AWQ"
        check_input_groups(where, group, in_features, full_in)
        check_packs(where, self.bits, out_features, "output")
        self.group = group
        groups = in_features // group
        weight_param(layer, "qweight", (in_features, out_features // per), torch.int32,
                     output_dim=1, input_dim=0, packed_dim=1, pack_factor=per)
        weight_param(layer, "qzeros", (groups, out_features // per), torch.int32,
                     output_dim=1, input_dim=0, packed_dim=1, pack_factor=per)
        weight_param(layer, "scales", (groups, out_features), torch.float32,
                     output_dim=1, input_dim=0)

    def _parts(self, layer) -> tuple[torch.Tensor, ...]:
        """(codes [N, K], group of each k [K], scale [N, G], zero [N, G])."""
        bits = self.bits
        codes = unpack_int32(layer.qweight.data, bits, 1, order=AWQ_ORDER).t()
        scale = layer.scales.data.t().float()
        if self.config.zero_point:
            zero = unpack_int32(layer.qzeros.data, bits, 1, order=AWQ_ORDER).t().float()
        else:
            zero = torch.full_like(scale, float(1 << (bits - 1)))
        groups = torch.arange(codes.shape[1]) // self.group
        return codes, groups, scale, zero
