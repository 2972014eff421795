"""Column- and row-parallel linear layers (plain linear layers at world size 1).

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that
copies its own slice of a full checkpoint tensor: tensor parallelism and the
fused qkv / gate-up projections both fall out of this.

Once loaded, bf16 weights on the CPU are repacked once (`prepack`): a
plain-layout weight is reordered inside every matmul call, which at decode
batch sizes costs as much as the multiplication (measured in
docs/benchmarks.md). Where the CPU has AVX512-BF16 (and no AMX), the weight is
packed for the native kernel (`folio.model.native.linear`), which at decode
sizes reads the weights about twice as fast as oneDNN; its sums run in another
order, so it matches `F.linear` to the last bf16 rounding (tested). Otherwise
oneDNN's blocked layout, bit-identical to `F.linear`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.model import native
from folio.worker.parallel_state import all_reduce, tp_rank, tp_size


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class PackedWeight:
    """A weight repacked once for the CPU's bf16 products: `packed(x, bias)`
    is x W^T + bias."""

    def __init__(self, data: torch.Tensor, out_features: int, native_kernel: bool,
                 bf16_weights: bool = False):
        self.data, self.out_features, self.native = data, out_features, native_kernel
        self.bf16_weights = bf16_weights       # fp32 x, bf16-stored W (the AVX2 kernel)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.bf16_weights:
            return native.linear_bf16w(x, self.data, self.out_features, bias)
        if self.native:
            return native.linear(x, self.data, self.out_features, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


def pack_onednn(weight: torch.Tensor) -> Optional[PackedWeight]:
    """The weight in oneDNN's blocked layout, or None where that does not apply
    (not the CPU, not bf16, or no oneDNN in this torch build)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        data = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError):
        return None
    return PackedWeight(data, weight.shape[0], native_kernel=False)


def pack_weight(weight: torch.Tensor, store: Optional[str] = None) -> Optional[PackedWeight]:
    """The weight packed for the native kernel where it serves, else for oneDNN,
    else None (the plain `F.linear` then). `store="bfloat16"`: an fp32 weight is
    kept as bf16 for the AVX2 kernel, where that kernel serves."""
    if store == "bfloat16" and weight.dtype == torch.float32 and \
            native.packs_linear_bf16w(weight):
        return PackedWeight(native.pack_linear_bf16w(weight), weight.shape[0], False, True)
    if native.packs_linear(weight):
        return PackedWeight(native.pack_linear(weight.detach()), weight.shape[0], True)
    return pack_onednn(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Optional[PackedWeight],
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return packed(x, bias)


def prepack(model: nn.Module, store: Optional[str] = None) -> None:
    """Repack every layer that can, once its weights are final (`store`: see
    pack_weight)."""
    for module in model.modules():
        if hasattr(module, "prepack"):
            module.prepack(store)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias: Optional[nn.Parameter] = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packed: Optional[PackedWeight] = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param.data, loaded)

    def prepack(self, store: Optional[str] = None) -> None:
        """Keep only the packed weight when there is one (the plain one would
        double the memory); the parameter stays, empty, for its name."""
        self.packed = pack_weight(self.weight, store)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit "
                         f"parameter of shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class ColumnParallelLinear(LinearBase):
    """y = x A^T with A's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, _divide(out_features, tp_size(), "output size"), bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        _copy(param.data, loaded.narrow(0, tp_rank() * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        self.output_sizes = [_divide(s, tp_size(), "output size") for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads. KV heads are replicated when
    there are fewer of them than ranks (each rank keeps the one it needs)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q, tp_rank()
        else:
            offset = q if shard_id == "k" else q + kv
            size, rank = kv, tp_rank() // self.kv_replicas
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """y = x A^T with A's columns (input features) split; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__(_divide(in_features, tp_size(), "input size"), out_features, bias, dtype)
        self.tp = tp_size()

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:            # the bias is added once, after the reduction
            _copy(param.data, loaded)
            return
        n = param.shape[1]
        _copy(param.data, loaded.narrow(1, tp_rank() * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(linear(x, self.weight, self.packed), self.tp)
        return y if self.bias is None else y + self.bias
