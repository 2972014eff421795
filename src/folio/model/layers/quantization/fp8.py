"""FP8 (e4m3) weights: the form every fp8 format hands over to, the method
that runs it, and `--quantization fp8` (round-to-nearest at load, per
output feature, of a float checkpoint).

A weight is its e4m3 codes c[n, k] (one byte each) and an fp32 scale per
output feature n and block of `block` input features b(k) = k // block:

    w[n, k] = e4m3(c[n, k]) * scale[n, b(k)]

compressed-tensors' FP8 checkpoints give channel scales (one block: `block`
= K), a tensor scale (the same, every row the layer's one value; a fused
layer's shards each their own) or 128x128 block scales (each row the scale
of its block of rows); `--quantization fp8` gives channel scales.

Execution, weight-only (the activations stay in the run's dtype; a
checkpoint's activation scheme, dynamic per token or static, is what fp8
products on a GPU would use, not built yet):
- on the CPU, `native/fp8linear.c` reads the codes (1 byte a weight) and
  sums each block's products in fp32, times its scale, block by block: the
  same arithmetic at every row count;
- elsewhere (no kernel, a GPU), the weight is dequantized per call and
  multiplied (the reference the kernel is tested against).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from folio.kernels import native
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig
from folio.model.layers.quantization.repacked import PackedLinear
from folio.model.layers.quantization.rtn import _LOAD_DTYPES, RTNLinearMethod

E4M3_MAX = 448.0
# rows quantized at a time: bounds the fp32 temporaries of a large layer
_ROWS = 1024


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [N, K] = e4m3(codes) * scales[:, k // block], in fp32, then `dtype`."""
    k = codes.shape[1]
    per_k = scales.float().repeat_interleave(block, dim=1)[:, :k]
    return (codes.view(torch.float8_e4m3fn).float() * per_k).to(dtype)


class Fp8Linear(PackedLinear):
    """A layer's fp8 weight: codes [N, K] and fp32 scales [N, ceil(K / block)].
    On the CPU with the native kernel the layer keeps only their packed copies
    (`data`: the codes, the bytes a step reads); elsewhere the codes as they
    are, dequantized per call."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, block: int):
        codes = codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
        n, k = codes.shape
        self.block, self.in_features = block, k
        self.kernel = codes.device.type == "cpu" and native.has_fp8_linear()
        if self.kernel:
            data, self.scales = native.pack_fp8_linear(codes, scales.float(), block)
        else:
            data, self.scales = codes.contiguous(), scales.float().contiguous()
        super().__init__(data, n)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] (from the packed copies where the kernel holds them)."""
        if not self.kernel:
            return dequantize(self.data, self.scales, self.block, dtype)
        n, k = self.out_features, self.in_features
        codes = self.data.transpose(1, 2).reshape(-1, k)[:n]
        scales = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[:n] / 256.0
        return dequantize(codes, scales, self.block, dtype)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.kernel and x.device.type == "cpu":
            out = native.fp8_linear(x.float(), self.data, self.scales, self.block,
                                    self.out_features, bias)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)


def quantize(weight: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest e4m3 codes of weight [N, K] with one fp32 scale per
    output feature, s = max |w| / 448 (1 where a row is all zeros): (codes
    float8_e4m3fn [N, K], scales fp32 [N, 1])."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    for r0 in range(0, n, _ROWS):
        part = weight[r0:r0 + _ROWS].float()
        if not bool(part.isfinite().all()):
            raise ValueError(f"{what}: weights that are not finite cannot be quantized to fp8")
        s = part.abs().amax(1, keepdim=True) / E4M3_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
        # the division may land a hair past 448, which e4m3 has no code for
        codes[r0:r0 + _ROWS] = (part / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scales[r0:r0 + _ROWS] = s
    return codes, scales


@register_quantization("fp8")
class Fp8Config(QuantizationConfig):
    """`--quantization fp8`: any float checkpoint (or a GGUF's weights,
    dequantized at load) loads as the plain method does, then each linear
    layer of the decoder is quantized to e4m3 with a scale per output feature
    (per output feature of each rank's slice under tensor parallelism: the
    same scales at every size for a column-parallel layer). The embeddings
    and the LM head stay float. `load_dtype` as for int8 (rtn.py)."""

    loads_float_weights = True

    def __init__(self, config: dict[str, Any], *, weight_dtype: Optional[str] = None):
        super().__init__(config, weight_dtype=weight_dtype)
        load = config.get("load_dtype")
        if load is not None and load not in _LOAD_DTYPES:
            raise ValueError(f"fp8 load_dtype {load!r} is not valid ({', '.join(_LOAD_DTYPES)})")
        self.load_dtype: Optional[torch.dtype] = _LOAD_DTYPES.get(load)

    def get_linear_method(self, layer, prefix: str) -> LinearMethod:
        return Fp8RTNMethod(self, prefix)


class Fp8RTNMethod(RTNLinearMethod):
    """int8's method (the plain float weight while loading, in `load_dtype`),
    quantized to e4m3 and handed over to `Fp8Linear` once loaded."""

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data
        codes, scales = quantize(weight, f"{self.prefix}: fp8")
        layer.quant_method = Fp8Linear(codes, scales, weight.shape[1])
        layer.weight.data = torch.empty(0, dtype=weight.dtype)
