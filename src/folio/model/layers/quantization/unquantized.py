"""The "none" format: plain float weights, as the checkpoint stores them (the
layers' own default, `layers.linear.PlainLinearMethod`, which repacks them for
the CPU kernels once loaded)."""

from __future__ import annotations

from torch import nn

from folio.model.layers.linear import PlainLinearMethod
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig


@register_quantization("none")
class UnquantizedConfig(QuantizationConfig):
    loads_float_weights = True

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return PlainLinearMethod(self.weight_dtype)
