"""GPTQ checkpoints (what GPTQModel / AutoGPTQ / optimum write).

Tensors of a quantized linear layer, as stored:
- `qweight` int32 [in * bits / 32, out]: the codes packed along the input
  axis, lowest bits first;
- `qzeros` int32 [groups, out * bits / 32]: the zero points packed along the
  output axis. `checkpoint_format: gptq` (v1, the default) stores zero - 1,
  `gptq_v2` the zero itself;
- `scales` [groups, out];
- `g_idx` int32 [in]: the group of each input feature. Without act-order
  (`desc_act: false`) it is k // group_size; with it, any order.

w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]. 4 and 8 bits, symmetric
or not, any group size dividing the input features, or -1 (one group).

Tensor parallelism shards qweight and g_idx along the input for a row-parallel
layer, and its scales and zeros along their group axis when every rank's
inputs are whole groups in order; with act-order the groups of a rank's rows
are anywhere, so each rank keeps every group's scales and zeros.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from folio.distributed.parallel_state import tp_rank, tp_size
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.int_checkpoint import (IntCheckpointMethod,
                                                        check_packs, unpack_int32)

_BITS = (4, 8)


@register_quantization("gptq")
class GPTQConfig(QuantizationConfig):
    def __init__(self, config: dict[str, Any], *, weight_dtype=None):
        super().__init__(config, weight_dtype=weight_dtype)
        self.bits = int(config.get("bits", 4))
        if self.bits not in _BITS:
            raise ValueError(f"GPTQ with {self.bits}-bit weights is not supported; supported: "
                             f"{', '.join(map(str, _BITS))} bits")
        self.group_size = int(config.get("group_size", 128))
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"GPTQ group_size {self.group_size} is not valid (a positive "
                             "number, or -1 for one group)")
        self.desc_act = bool(config.get("desc_act", False))
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: "
                             "gptq, gptq_v2")
        self.zero_minus_one = fmt == "gptq"
        if config.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head is not supported (the decoder's "
                             "linear layers are)")
        if config.get("dynamic"):
            raise ValueError("GPTQ with per-module overrides (`dynamic`) is not supported")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GPTQLinearMethod(self, prefix)


class GPTQLinearMethod(IntCheckpointMethod):
    checkpoint_tensors = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: GPTQConfig, prefix: str):
        self.config, self.prefix, self.bits = config, prefix, config.bits

    def create_weights(self, layer, in_features, out_features, dtype):
        per = 32 // self.bits
        row_parallel = getattr(layer, "input_is_parallel", False)
        full_in = in_features * (tp_size() if row_parallel else 1)
        group = self.config.group_size if self.config.group_size != -1 else full_in
        where = f"{self.prefix}: GPTQ"
        check_packs(where, self.bits, in_features, "input")
        check_packs(where, self.bits, out_features, "output")
        # scales and zeros follow the rank's inputs only where those are whole
        # groups in order; else (act-order, a rank's inputs splitting a group,
        # a last group shorter than the others as gptqmodel writes for 576
        # inputs in groups of 128) each rank keeps every group's
        split_groups = not self.config.desc_act and in_features % group == 0
        groups = in_features // group if split_groups else -(-full_in // group)
        group_dim = 0 if split_groups else None
        weight_param(layer, "qweight", (in_features // per, out_features), torch.int32,
                     output_dim=1, input_dim=0, packed_dim=0, pack_factor=per)
        weight_param(layer, "qzeros", (groups, out_features // per), torch.int32,
                     output_dim=1, input_dim=group_dim, packed_dim=1, pack_factor=per)
        weight_param(layer, "scales", (groups, out_features), torch.float32,
                     output_dim=1, input_dim=group_dim)
        weight_param(layer, "g_idx", (in_features,), torch.int32, output_dim=None, input_dim=0)
        # the global index of this rank's first group, where groups are split
        self.first_group = tp_rank() * groups if row_parallel and split_groups else 0

    def _parts(self, layer) -> tuple[torch.Tensor, ...]:
        """(codes [N, K], group of each k [K], scale [N, G], zero [N, G])."""
        bits = self.bits
        codes = unpack_int32(layer.qweight.data, bits, 0).t()
        zeros = unpack_int32(layer.qzeros.data, bits, 1).t().float()
        if self.config.zero_minus_one:
            zeros = zeros + 1
        g_idx = layer.g_idx.data.to(torch.int64)
        g_idx = g_idx - self.first_group      # a row-parallel rank's own groups
        groups = layer.scales.shape[0]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"{self.prefix}: GPTQ g_idx holds groups outside 0..{groups - 1}")
        return codes, g_idx, layer.scales.data.t().float(), zeros
