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

Execution:
- fp8 products (W8A8) on GPUs that have them (CUDA compute capability 8.9
  or more), for channel and tensor scales: each row of the activations
  quantized to e4m3 with its own scale, max |x| / 448 (dynamic per token, as
  FP8_DYNAMIC and `--quantization fp8` say), or with the checkpoint's static
  `input_scale` (FP8), then `torch._scaled_mm` with the two rows of scales;
  the activations as the checkpoint declares them, so compressed-tensors'
  own output is reproduced (tested on the CPU, where torch runs the same
  call);
- weight-only elsewhere (the activations stay in the run's dtype): on the
  CPU `native/fp8linear.c` reads the codes (1 byte a weight) and sums each
  block's products in fp32, times its scale, block by block, the same
  arithmetic at every row count; on GPUs without fp8 products, and for
  block scales on any (`_scaled_mm`'s row scales do not take them),
  `kernels/triton_fp8.py` reads them; with neither, the weight is
  dequantized per call and multiplied (the reference both kernels are
  tested against).
"""

from __future__ import annotations

import functools
import logging
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F

from folio.kernels import native
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig
from folio.model.layers.quantization.int_groups import has_triton
from folio.model.layers.quantization.repacked import PackedLinear
from folio.model.layers.quantization.rtn import _LOAD_DTYPES, RTNLinearMethod

logger = logging.getLogger("folio")

E4M3_MAX = 448.0
# rows quantized at a time: bounds the fp32 temporaries of a large layer
_ROWS = 1024


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [N, K] = e4m3(codes) * scales[:, k // block], in fp32, then `dtype`."""
    k = codes.shape[1]
    per_k = scales.float().repeat_interleave(block, dim=1)[:, :k]
    return (codes.view(torch.float8_e4m3fn).float() * per_k).to(dtype)


def fp8_products(device: torch.device) -> bool:
    """Whether `device` multiplies fp8 by fp8 (CUDA compute capability 8.9 or
    more: Ada, Hopper and after)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _say_dequantized(device: torch.device) -> None:
    """Once per device: fp8 weights dequantized per call are slow."""
    logger.warning("fp8 weights on %s run dequantized per call (no fp8 kernel here): correct, "
                   "and slower than the same model in its float dtype", device)


def quantize_rows(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 scales [M, 1]): each row by its own
    max |x| / 448, or all by `static_scale` (compressed-tensors' fake
    quantization: x / s clamped to +-448, rounded to nearest even)."""
    xf = x.float()
    if static_scale is None:
        s = xf.abs().amax(-1, keepdim=True) / E4M3_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
    else:
        s = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (xf / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s.contiguous()


class Fp8Linear(PackedLinear):
    """A layer's fp8 weight: codes [N, K] and fp32 scales [N, ceil(K / block)],
    and a static activation scale where the checkpoint has one. On the CPU
    with the native kernel the layer keeps only their packed copies (`data`:
    the codes, the bytes a step reads); elsewhere the codes as they are, run
    by `_scaled_mm` where the device has fp8 products and the scales are one
    a row (`products`), else dequantized per call."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, block: int,
                 input_scale: Optional[torch.Tensor] = None):
        codes = codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
        n, k = codes.shape
        self.block, self.in_features, self.input_scale = block, k, input_scale
        # (CUDA's fp8 products take sizes in multiples of 16)
        self.products = fp8_products(codes.device) and block >= k and n % 16 == 0 \
            and k % 16 == 0
        self.kernel = (not self.products and codes.device.type == "cpu"
                       and native.has_fp8_linear())
        if self.kernel:
            data, self.scales = native.pack_fp8_linear(codes, scales.float(), block)
        else:
            data, self.scales = codes.contiguous(), scales.float().contiguous()
        # GPUs without fp8 products, and block scales on any: the Triton kernel
        self.triton = not self.products and codes.device.type == "cuda" and has_triton()
        if not (self.products or self.kernel or self.triton):
            _say_dequantized(codes.device)
        super().__init__(data, n)
        # the one-call native decoder runs the kernel's packed form (fp32 activations)
        self.native_kind = "fp8" if self.kernel else None
        # _scaled_mm's second operand: [K, N] column-major (the codes' transpose
        # as a view), its scales one row [1, N]
        self.scales_t = self.scales.reshape(1, n) if self.products else None

    def scaled_mm(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The fp8 product: x's rows quantized (dynamic, or the static scale),
        times the codes, both rows of scales applied by `_scaled_mm`."""
        lead = x.shape[:-1]
        xq, xs = quantize_rows(x.reshape(-1, self.in_features), self.input_scale)
        # CUDA's row-scaled products write bf16 only
        dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = torch._scaled_mm(xq, self.data.view(torch.float8_e4m3fn).t(), scale_a=xs,
                               scale_b=self.scales_t, out_dtype=dtype)
        out = out.to(x.dtype).reshape(*lead, self.out_features)
        return out if bias is None else out + bias.to(out.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] (from the packed copies where the kernel holds them)."""
        if not self.kernel:
            return dequantize(self.data, self.scales, self.block, dtype)
        n, k = self.out_features, self.in_features
        codes = self.data.transpose(1, 2).reshape(-1, k)[:n]
        scales = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[:n] / 256.0
        return dequantize(codes, scales, self.block, dtype)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.products:
            return self.scaled_mm(x, bias)
        if self.triton and x.is_cuda:
            from folio.kernels.triton_fp8 import fp8_linear
            return fp8_linear(x, self.data, self.scales, self.block, bias)
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
    """int8's method (the plain float weight, in `load_dtype`), except that the
    float weight exists only while its layer loads: the parameter is empty
    until the first of the layer's checkpoint tensors arrives, and the layer
    is quantized to e4m3 (`Fp8Linear`) and its float weight dropped as soon
    as the last arrives. So a model never holds more than a layer's weights
    in float beside its codes (70B in bf16 would not fit one H200)."""

    def create_weights(self, layer, in_features, out_features, dtype):
        super().create_weights(layer, in_features, out_features, dtype)
        param = layer.weight
        self.shape, self.dtype, self.device = tuple(param.shape), param.dtype, param.device
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        param.weight_loader = partial(self._load, layer)
        # the checkpoint tensors that fill the layer: each of its fused shards, or one
        if hasattr(layer, "output_sizes"):
            self.shards = set(range(len(layer.output_sizes)))
        elif hasattr(layer, "num_kv_heads"):
            self.shards = {"q", "k", "v"}
        else:
            self.shards = {None}
        self.ready: Optional[Fp8Linear] = None

    def _load(self, layer, param, loaded, shard_id=None):
        if self.ready is not None:
            raise ValueError(f"{self.prefix}: a checkpoint tensor of a layer already "
                             "quantized to fp8 (a tensor given twice?)")
        if param.numel() == 0:
            param.data = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        layer.weight_loader(param, loaded, shard_id)
        self.shards.discard(shard_id)
        if not self.shards:
            self.ready = self._quantized(param)

    def _quantized(self, param) -> Fp8Linear:
        weight = param.data
        codes, scales = quantize(weight, f"{self.prefix}: fp8")
        param.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        return Fp8Linear(codes, scales, weight.shape[1])

    def process_weights_after_loading(self, layer):
        layer.quant_method = self.ready or self._quantized(layer.weight)

    def apply(self, layer, x, bias=None):
        raise RuntimeError(f"{self.prefix}: -q fp8 layer called before it was loaded")
