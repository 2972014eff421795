"""How a fused MoE layer (moe.py) holds its experts' matrices once loaded, and
how a checkpoint whose experts are stored quantized loads them.

Every expert matrix ends up as one callable `(x, bias) -> x W^T`, the form
the packed products take (FusedMoE.packed_experts, a (gate-and-up, down)
pair per expert):
- `ExpertMatrix`: an IntGroups (the codes of GPTQ, AWQ, compressed-tensors,
  a GGUF's packable types, `-q int8|int4`), run on IntGroupsLinear's kernels;
  the one-call native decoder runs these;
- a PackedLinear (linear.py's pack_weight: float experts on the CPU);
- `ExpertLayer`: a layer kept as its method left it (a float weight no
  kernel packs).

A quantized checkpoint's experts (GPTQ, AWQ, compressed-tensors) load as
that format's dense layers do: each expert's gate and up are one
column-parallel layer (`experts.{e}.gate_up_proj`) and its down a
row-parallel one (`.down_proj`), each created by the format's own method
(`quant_config.get_linear_method`), so tensor parallelism slices every
expert's tensors along the format's own axes and each format's checks
apply; every tensor names the checkpoint tensor that fills it
(`{prefix}.experts.{e}.{gate|up|down}.<tensor>`). FusedMoE prepares them
(`prepared`) and keeps only the result, dropping the layers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.model.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from folio.model.layers.quantization.int_groups import IntGroupsLinear
from folio.model.layers.quantization.repacked import PackedLinear


class ExpertMatrix(IntGroupsLinear):
    """One quantized expert matrix, called as the packed products are: (x, bias)."""

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.apply(None, x, bias)


class ExpertLayer:
    """One expert matrix kept neither as IntGroups nor packed (a float weight
    F.linear multiplies as it is), called as the packed products are: its
    layer's own method (never all-reduced: the MoE layer reduces the sum of
    its experts). `data`: the weight, for the weight report."""

    native_kind = None      # the one-call decoder declines these

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.data = layer.weight.data

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.layer.quant_method.apply(self.layer, x, bias)


class _HeldColumns(MergedColumnParallelLinear):
    """An expert's gate and up, prepared by its FusedMoE (`prepared`), not by
    the walk over the model's modules."""

    def process_weights_after_loading(self) -> None:
        pass


class _HeldRows(RowParallelLinear):
    """An expert's down, prepared by its FusedMoE as _HeldColumns."""

    def process_weights_after_loading(self) -> None:
        pass


def checkpoint_experts(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                       quant_config, prefix: str, names: tuple[str, str, str]) -> nn.ModuleList:
    """Every expert's (gate_up_proj, down_proj) layers in the format's tensors,
    `intermediate` the full size (the layers split it by rank), each tensor
    filled from `{prefix}.experts.{e}.{name}.<tensor>`."""
    gate, up, down = names
    # the fused layer's name spells its parts as gguf.FUSED does, which
    # compressed-tensors matches its targets and ignores against
    fused = "gate_up_proj" if gate == "gate_proj" else f"{gate}_{up}"
    experts = []
    for e in range(num_experts):
        at = f"{prefix}.experts.{e}"
        expert = nn.Module()
        expert.gate_up_proj = _HeldColumns(hidden, [intermediate] * 2, False, dtype,
                                           quant_config, f"{at}.{fused}")
        expert.down_proj = _HeldRows(intermediate, hidden, False, dtype, quant_config,
                                     f"{at}.{down}")
        for name, param in expert.gate_up_proj.named_parameters():
            param.checkpoint_names = {0: f"{at}.{gate}.{name}", 1: f"{at}.{up}.{name}"}
        for name, param in expert.down_proj.named_parameters():
            param.checkpoint_names = {None: f"{at}.{down}.{name}"}
        experts.append(expert)
    return nn.ModuleList(experts)


def prepared(layer: LinearBase):
    """A checkpoint expert's layer, prepared by its method: its IntGroups as an
    ExpertMatrix, or its packed float weight (a format that leaves the
    experts unquantized, e.g. compressed-tensors' `ignore`), as the kernels
    and the one-call decoder run them; else the layer itself (ExpertLayer)."""
    LinearBase.process_weights_after_loading(layer)
    method = layer.quant_method
    if isinstance(method, IntGroupsLinear):
        return ExpertMatrix(method.weights)
    return method if isinstance(method, PackedLinear) else ExpertLayer(layer)
