"""What a weight method is: how one linear layer creates, loads, prepares and
applies its weights, and the quantization config that picks a method per layer.

The layer (`layers/linear.py`) owns the parallel geometry: which slice of a
checkpoint tensor belongs to this tensor-parallel rank and where a fused shard
(q, k, v; gate, up) goes. The method owns the tensors: their names, shapes and
dtypes as the checkpoint stores them, what happens to them once loaded (a
repack for a kernel), and the product. Each parameter a method creates says
which of its axes holds the layer's output and input features (`output_dim`,
`input_dim`) and, for a packed tensor, which axis is packed and by how much
(`packed_dim`, `pack_factor`: e.g. eight 4-bit values per int32), so that the
layer's loader can shard any method's tensors without knowing the format.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def weight_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, *,
                 output_dim: Optional[int], input_dim: Optional[int],
                 packed_dim: Optional[int] = None, pack_factor: int = 1) -> nn.Parameter:
    """Register `name` on `layer` (empty, to be loaded) with its sharding axes and
    the layer's loader."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    param.packed_dim, param.pack_factor = packed_dim, pack_factor
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)
    return param


def shard_units(param: nn.Parameter, dim: int, features: int) -> int:
    """`features` output (or input) features in units of the parameter's axis `dim`."""
    if getattr(param, "packed_dim", None) == dim:
        if features % param.pack_factor:
            raise ValueError(f"{features} features do not split into whole packed elements "
                             f"of {param.pack_factor}")
        return features // param.pack_factor
    return features


class LinearMethod:
    """One linear layer's weights. Subclasses create the parameters in
    `create_weights`, may transform them once in `process_weights_after_loading`
    (a method may also hand the layer over to another method there, as the
    plain one does to a repacked kernel), and compute x W^T + bias in `apply`."""

    # What the one-call native decoder needs to run this layer itself: the
    # kernel ("bf16": folio_linear, "bf16_weights": folio_linear_bf16w) and the
    # packed tensor it reads. None: the layer runs only through `apply`.
    native_kind: Optional[str] = None

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def native_weight(self) -> Optional[torch.Tensor]:
        return None


class QuantizationConfig:
    """A weight format, detected from the checkpoint (`quantization_config` in
    config.json, tensor types in a GGUF) or named with --quantization: picks
    the method of every linear layer. `name` is the registry key (and the
    `quant_method` value of config.json)."""

    name: str = ""
    # True: the layers load a float checkpoint's own weights (and may quantize
    # them once loaded), so any float checkpoint serves the format, a GGUF's
    # weights dequantized at load included ("none", int8, int4); False: the
    # format reads tensors of its own, which only its checkpoints hold.
    loads_float_weights: bool = False
    # the checkpoint holds static KV cache scales (each attention's k_scale and
    # v_scale: compressed-tensors' kv_cache_scheme), which an fp8 cache takes:
    # "tensor" (one each) or "attn_head" (one per KV head); None: none
    kv_cache_scales: Optional[str] = None

    def __init__(self, config: dict[str, Any], *, weight_dtype: Optional[str] = None):
        self.config, self.weight_dtype = config, weight_dtype

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        raise NotImplementedError

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethod]:
        """The method of an embedding table (or LM head) kept in the format's
        codes, or None: a float table (what GPTQ and AWQ checkpoints keep)."""
        return None
