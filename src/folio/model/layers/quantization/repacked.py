"""The repacks the CPU kernels read: three methods beside the plain one.

Once loaded, a plain float weight on the CPU may be repacked
(`layers.linear.pack_weight` picks which) and its layer handed over to one of
these, each owning only its packed copy:

- `NativeBF16Linear`: the native kernel's tiles (CPUs with AVX512-BF16; on
  AMX ones where the kernel multiplies many rows on the AMX tiles itself),
  about twice as fast as oneDNN at decode sizes; its sums run in another
  order, so it matches F.linear to the last bf16 rounding (tested);
- `OneDNNLinear`: oneDNN's blocked layout, bit-identical to F.linear (a
  plain-layout weight is reordered inside every matmul call, which at decode
  sizes costs as much as the multiplication);
- `BF16StoredLinear`: an fp32 weight kept as bf16 for the AVX2 kernel (fp32
  arithmetic, half the bytes), for --dtype bfloat16 on CPUs without native
  bf16 (`weight_dtype="bfloat16"`).
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.kernels import native
from folio.model.layers.quantization.base import LinearMethod


class PackedLinear(LinearMethod):
    """A weight repacked once for one CPU kernel: `packed(x, bias)` is x W^T + bias."""

    native = False           # the AVX512-BF16 kernel's layout
    bf16_weights = False     # fp32 x, bf16-stored W (the AVX2 kernel)

    def __init__(self, data: torch.Tensor, out_features: int):
        self.data, self.out_features = data, out_features

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer, x, bias=None):
        return self(x, bias)

    def native_weight(self) -> Optional[torch.Tensor]:
        return self.data if self.native_kind else None


class NativeBF16Linear(PackedLinear):
    native, native_kind = True, "bf16"

    def __call__(self, x, bias):
        return native.linear(x, self.data, self.out_features, bias)


class BF16StoredLinear(PackedLinear):
    bf16_weights, native_kind = True, "bf16_weights"

    def __call__(self, x, bias):
        return native.linear_bf16w(x, self.data, self.out_features, bias)


class OneDNNLinear(PackedLinear):
    def __call__(self, x, bias):
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


def pack_onednn(weight: torch.Tensor) -> Optional[OneDNNLinear]:
    """The weight in oneDNN's blocked layout, or None where that does not apply
    (not the CPU, not bf16, or no oneDNN in this torch build)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        data = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError):
        return None
    return OneDNNLinear(data, weight.shape[0])
