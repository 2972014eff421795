"""`--quantization int8` and `--quantization int4`: round-to-nearest (RTN)
weight-only quantization, at load, of a plain float checkpoint (bf16, fp16
or fp32), for users who have no quantized checkpoint. A GGUF serves too: its
blocks are dequantized to float at load and its linear weights requantized
here (a second rounding, on top of the file's own; engine/config_builder.py
says so in the log).

Each linear layer of the decoder loads its float [out, in] weight exactly as
the plain method does (so tensor parallelism shards it as a plain weight),
then quantizes it once, per output feature n and group of input features g:

- int8 (default: one group per output feature, i.e. per channel): symmetric,
  s = max |w| / 127, q = round(w / s) + 128 (codes 0..255, zero point 128);
- int4 (default: groups of 128 input features): asymmetric min/max with the
  range widened to hold 0 (as GPTQ's quantizer does), s = (max - min) / 15,
  zero z = round(-min / s) in 0..15, q = clamp(round(w / s) + z, 0, 15).

and the layer keeps only the packed `IntGroups` (about bits/8 bytes a weight
plus 4 bytes per group and output feature), w = (q - z) * s. The scales are
computed in fp32 and rounded *up* to the nearest float16 (IntGroups stores
float16 scales); the codes are computed with that stored scale, so the packed
form dequantizes to exactly (q - z) * s of what is stored, every weight is
within s / 2 of the checkpoint's, and no code needs clamping to fit (the
clamp is only for the rounding of a half). A group that is all zeros gets
scale 1 and codes at the zero point (weights 0). The embeddings and lm_head
stay float.

Options, from the config dict (the CLI gives none, so these are the
defaults): `group_size` (int8: -1, per channel; int4: 128; -1 means one group
per output feature) and `sym` (int8: true; int4: false; symmetric uses
s = max |w| / (2^(bits-1) - 1) around zero point 2^(bits-1)), and
`load_dtype`, which engine/config_builder.py sets to the checkpoint's own
dtype: the float weights load in it rather than in the run dtype, so each is
quantized from the checkpoint's value (a bf16 run would otherwise round an
fp32 checkpoint's weights, or a GGUF's dequantized ones, to bf16 first: a
rounding of up to a quarter of int8's step before int8's own).

Groups are runs of `group_size` input features counted from the start of the
checkpoint's input axis. Where a layer's input features are not a multiple
of the group size the last group is shorter (e.g. 576 inputs: four groups of
128 and one of 64) rather than the layer falling back to per channel or being
refused: the CLI cannot pass another group size, so refusing would make int4
unusable on such models (SmolLM's hidden size 576, Qwen2-0.5B's 896 at
tensor-parallel size 2), a per-channel int4 layer is several times less
accurate, and IntGroups and its kernel take groups of any length. A
row-parallel rank quantizes only its slice of the input axis, so a group
that crosses the boundary between two ranks' slices becomes two shorter
groups, one on each rank (its weights then differ slightly from the
tensor-parallel size 1 quantization); where every rank's slice is a multiple
of the group size (e.g. hidden 4096, group 128, any size up to 32) the
quantized weights are the same at every tensor-parallel size. Per-channel
int8 on a row-parallel layer is per channel of each rank's slice.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.distributed.parallel_state import tp_rank
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.int_checkpoint import hand_over
from folio.model.layers.quantization.int_groups import IntGroups

# rows quantized at a time: bounds the fp32 temporaries of a large layer
_ROWS = 1024
# load_dtype -> the loaded weights' dtype (quantize() computes in fp32 anyway)
_LOAD_DTYPES = {"float32": torch.float32, "float64": torch.float32,
                "bfloat16": torch.bfloat16, "float16": torch.float16}


class RTNConfig(QuantizationConfig):
    """Round-to-nearest at load; `bits`, and the defaults, per subclass."""

    bits: int = 0
    default_group_size: int = -1
    default_sym: bool = True
    loads_float_weights = True

    def __init__(self, config: dict[str, Any], *, weight_dtype: Optional[str] = None):
        super().__init__(config, weight_dtype=weight_dtype)
        group = config.get("group_size", self.default_group_size)
        if isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1:
            raise ValueError(f"{self.name} group_size {group!r} is not valid (a positive "
                             "number of input features, or -1 for one group per output "
                             "feature)")
        self.group_size: int = group
        sym = config.get("sym", self.default_sym)
        if not isinstance(sym, bool):
            raise ValueError(f"{self.name} sym {sym!r} is not valid (true or false)")
        self.sym: bool = sym
        load = config.get("load_dtype")
        if load is not None and load not in _LOAD_DTYPES:
            raise ValueError(f"{self.name} load_dtype {load!r} is not valid "
                             f"({', '.join(_LOAD_DTYPES)})")
        self.load_dtype: Optional[torch.dtype] = _LOAD_DTYPES.get(load)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return RTNLinearMethod(self, prefix)


@register_quantization("int8")
class Int8Config(RTNConfig):
    bits, default_group_size, default_sym = 8, -1, True


@register_quantization("int4")
class Int4Config(RTNConfig):
    bits, default_group_size, default_sym = 4, 128, False


def group_of_inputs(in_features: int, group_size: int, first: int = 0) -> torch.Tensor:
    """The group (0, 1, ...) of each of `in_features` inputs that start at the
    checkpoint's input `first`: runs of `group_size` counted from input 0
    (-1: one group)."""
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int64)
    g = torch.div(torch.arange(first, first + in_features), group_size, rounding_mode="floor")
    return g - (g[0] if in_features else 0)


def float16_at_least(s: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= each s (fp32, >= 0), and 1 where s is 0: a
    scale that stores exactly, never smaller than the one needed."""
    h = s.half()
    up = h.float() < s
    h = torch.where(up, (h.view(torch.int16) + 1).view(torch.float16), h)
    return torch.where(h == 0, torch.ones_like(h), h)


def quantize(weight: torch.Tensor, groups: torch.Tensor, bits: int, sym: bool,
             what: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes of weight [N, K] by the groups [K] (consecutive
    runs 0, 1, ...): (codes uint8 [N, K], scale float16 [N, G], zero [N, G]
    fp32 integers), w ~ (codes - zero) * scale."""
    n, k = weight.shape
    num_groups = int(groups.max()) + 1 if k else 0
    _, lengths = torch.unique_consecutive(groups, return_counts=True)
    starts = [0] + torch.cumsum(lengths, 0).tolist()
    top = (1 << bits) - 1
    codes = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n, num_groups, dtype=torch.float16, device=weight.device)
    zero = torch.empty(n, num_groups, dtype=torch.float32, device=weight.device)
    for r0 in range(0, n, _ROWS):
        r1 = min(r0 + _ROWS, n)
        for g, (k0, k1) in enumerate(zip(starts[:-1], starts[1:])):
            part = weight[r0:r1, k0:k1].float()
            if sym:
                half = 1 << (bits - 1)
                s = float16_at_least(part.abs().amax(1) / (half - 1))
                z = torch.full_like(s, half, dtype=torch.float32)
            else:
                lo = part.amin(1).clamp(max=0)
                hi = part.amax(1).clamp(min=0)
                s = float16_at_least((hi - lo) / top)
                z = torch.round(-lo / s.float()).clamp(0, top)
            if not bool(s.isfinite().all()) or not bool(part.isfinite().all()):
                raise ValueError(f"{what}: weights of magnitude up to "
                                 f"{part.abs().max().item():.4g} cannot be quantized to "
                                 f"{bits} bits with float16 scales")
            q = torch.round(part / s.float()[:, None]) + z[:, None]
            codes[r0:r1, k0:k1] = q.clamp(0, top).to(torch.uint8)
            scale[r0:r1, g], zero[r0:r1, g] = s, z
    return codes, scale, zero


class RTNLinearMethod(LinearMethod):
    """The plain float weight while loading; quantized and handed over to
    `IntGroupsLinear` once loaded."""

    def __init__(self, config: RTNConfig, prefix: str):
        self.config, self.prefix = config, prefix

    def create_weights(self, layer, in_features, out_features, dtype):
        weight_param(layer, "weight", (out_features, in_features),
                     self.config.load_dtype or dtype, output_dim=0, input_dim=1)
        # where this rank's inputs start on the checkpoint's input axis
        row_parallel = getattr(layer, "input_is_parallel", False)
        self.first_input = tp_rank() * in_features if row_parallel else 0

    def groups(self, in_features: int) -> torch.Tensor:
        return group_of_inputs(in_features, self.config.group_size, self.first_input)

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data
        groups = self.groups(weight.shape[1])
        what = f"{self.prefix}: {self.config.name}"
        codes, scale, zero = quantize(weight, groups, self.config.bits, self.config.sym, what)
        packed = IntGroups.from_codes(codes, groups, scale, self.config.bits, zero=zero)
        hand_over(layer, packed, "weight")

    def apply(self, layer, x, bias=None):
        # only before the weights are processed (the layer is handed over then)
        return F.linear(x, layer.weight.to(x.dtype), bias)
