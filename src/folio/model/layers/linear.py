"""Column- and row-parallel linear layers (plain linear layers at world size 1).

A layer owns the parallel geometry; its weight method (`quant_method`, from
`layers/quantization/`) owns the tensors. Each parameter a method creates
carries the layer's `weight_loader(param, loaded, shard_id=None)`, which copies
this rank's slice of a full checkpoint tensor along the axis the parameter
says holds the output (column-parallel) or input (row-parallel) features, in
packed units where that axis is packed: tensor parallelism and the fused
qkv / gate-up projections both fall out of this, for every format.

The default method is the plain one below: the checkpoint's float [out, in]
weight and F.linear. Once loaded, a bf16 weight on the CPU is repacked once
(`pack_weight`) and the layer handed over to the method of that packed copy
(`quantization/repacked.py`): a plain-layout weight is reordered inside every
matmul call, which at decode batch sizes costs as much as the multiplication
(measured in docs/benchmarks.md). Where the CPU has AVX512-BF16, the weight
is packed for the native kernel, which at decode sizes reads the weights
about twice as fast as oneDNN (on an AMX CPU it multiplies many rows on the
tiles; where it was built without that path, oneDNN keeps AMX CPUs); its sums
run in another order, so it matches `F.linear` to the last bf16 rounding
(tested). Otherwise oneDNN's
blocked layout, bit-identical to `F.linear`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.kernels import native
from folio.model.layers.quantization.base import (LinearMethod, QuantizationConfig, shard_units,
                                                  weight_param)
from folio.model.layers.quantization.repacked import (BF16StoredLinear, NativeBF16Linear,
                                                      PackedLinear, pack_onednn)
from folio.distributed.parallel_state import all_reduce, tp_rank, tp_size

__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "RowParallelLinear", "PlainLinearMethod", "linear", "pack_onednn", "pack_weight",
           "process_weights_after_loading", "prepack"]


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


def pack_weight(weight: torch.Tensor, store: Optional[str] = None) -> Optional[PackedLinear]:
    """The weight packed for the native kernel where it serves, else for oneDNN,
    else None (the plain `F.linear` then). `store="bfloat16"`: an fp32 weight is
    kept as bf16 for the AVX2 kernel, where that kernel serves."""
    if store == "bfloat16" and weight.dtype == torch.float32 and \
            native.packs_linear_bf16w(weight):
        return BF16StoredLinear(native.pack_linear_bf16w(weight), weight.shape[0])
    if native.packs_linear(weight):
        return NativeBF16Linear(native.pack_linear(weight.detach()), weight.shape[0])
    return pack_onednn(weight)


class PlainLinearMethod(LinearMethod):
    """The checkpoint's float [out, in] weight in the run dtype. `store`: see
    pack_weight (FolioConfig.weight_dtype)."""

    def __init__(self, store: Optional[str] = None):
        self.store = store

    def create_weights(self, layer, in_features, out_features, dtype):
        weight_param(layer, "weight", (out_features, in_features), dtype,
                     output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer):
        """Hand the layer to a repacked method where one serves, keeping only the
        packed copy (the plain one would double the memory); the parameter
        stays, empty, for its name."""
        packed = pack_weight(layer.weight, self.store)
        if packed is not None:
            layer.quant_method = packed
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Optional[PackedLinear],
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return packed(x, bias)


def process_weights_after_loading(model: nn.Module, exclude: Optional[nn.Module] = None) -> None:
    """Let every layer's method prepare its weights, once they are final (but
    those of `exclude`'s modules, prepared already)."""
    done = set(exclude.modules()) if exclude is not None else set()
    for module in model.modules():
        if module not in done and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


prepack = process_weights_after_loading     # the name the layer tests use


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method: LinearMethod = (PlainLinearMethod() if quant_config is None
                                           else quant_config.get_linear_method(self, prefix))
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        if bias:
            weight_param(self, "bias", (out_features,), dtype, output_dim=0, input_dim=None)
        else:
            self.bias: Optional[nn.Parameter] = None
        self.lora = None        # model/lora/layers.py's LoRASlots, where adapters run

    @property
    def packed(self) -> Optional[PackedLinear]:
        """The repacked copy the layer runs on, if it was handed one."""
        method = self.quant_method
        return method if isinstance(method, PackedLinear) else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param.data, loaded)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora(x, y)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit "
                         f"parameter of shape {tuple(dst.shape)}")
    if not dst.dtype.is_floating_point and src.dtype != dst.dtype:
        raise ValueError(f"checkpoint tensor of dtype {src.dtype} does not fit a packed "
                         f"{dst.dtype} parameter")
    dst.copy_(src.to(dst.dtype))


def _rank_slice(param: nn.Parameter, loaded: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """This rank's slice of `loaded` along `dim` (the whole tensor if None)."""
    if dim is None:
        return loaded
    n = param.shape[dim]
    return loaded.narrow(dim, tp_rank() * n, n)


class ColumnParallelLinear(LinearBase):
    """y = x A^T with A's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        super().__init__(in_features, _divide(out_features, tp_size(), "output size"), bias, dtype,
                         quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param.data, _rank_slice(param, loaded, param.output_dim))

    def _load_shard(self, param, loaded, offset: int, size: int, rank: int) -> None:
        """A fused shard: `size` output features at `offset` (per rank), taken
        from rank `rank`'s slice of the checkpoint tensor."""
        d = param.output_dim
        if d is None:                   # one value for the whole layer
            _copy(param.data, loaded)
            return
        offset, size = shard_units(param, d, offset), shard_units(param, d, size)
        _copy(param.data.narrow(d, offset, size), loaded.narrow(d, rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        self.output_sizes = [_divide(s, tp_size(), "output size") for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, dtype, quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None):
        offset = sum(self.output_sizes[:shard_id])
        self._load_shard(param, loaded, offset, self.output_sizes[shard_id], tp_rank())


def heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int, int]:
    """(query heads, KV heads, ranks sharing each KV head) of one rank: KV heads
    are replicated when there are fewer of them than ranks. `folio plan` sizes
    ranks with this too. A tensor-parallel size that does not divide is a ValueError."""
    heads = _divide(num_heads, tp, "number of attention heads")
    if num_kv_heads >= tp:
        return heads, _divide(num_kv_heads, tp, "number of KV heads"), 1
    return heads, 1, _divide(tp, num_kv_heads, "tensor-parallel size over KV heads")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads. KV heads are replicated when
    there are fewer of them than ranks (each rank keeps the one it needs)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads, self.kv_replicas = heads_per_rank(
            num_heads, num_kv_heads, tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias, dtype, quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            self._load_shard(param, loaded, 0, q, tp_rank())
        else:
            offset = q if shard_id == "k" else q + kv
            self._load_shard(param, loaded, offset, kv, tp_rank() // self.kv_replicas)


class RowParallelLinear(LinearBase):
    """y = x A^T with A's columns (input features) split; partial sums all-reduced."""

    input_is_parallel = True        # for weight methods, while they create their tensors

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        super().__init__(_divide(in_features, tp_size(), "input size"), out_features, bias, dtype,
                         quant_config, prefix)
        self.tp = tp_size()

    def weight_loader(self, param, loaded, shard_id=None):
        # the bias (no input axis) is added once, after the reduction
        _copy(param.data, _rank_slice(param, loaded, param.input_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if self.lora is not None:
            y = self.lora(x, y)
        y = all_reduce(y, self.tp)
        return y if self.bias is None else y + self.bias
