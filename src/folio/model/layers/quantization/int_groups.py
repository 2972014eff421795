"""One packed form for every 4-, 6- and 8-bit weight format, and the method
that runs it.

Every format Folio reads (GPTQ, AWQ, compressed-tensors, GGUF's Q4_0, Q4_1
and Q8_0, round-to-nearest at load) stores, for each output feature n and
input feature k, an unsigned integer code q[n, k] of `bits` bits, and per
(n, group of k) a scale and an offset, so that

    w[n, k] = q[n, k] * scale[n, g(k)] + offset[n, g(k)]

A format with integer zero points (GPTQ, AWQ, compressed-tensors) gives
them as they are, offset = -zero * scale computed in fp32 where it is used,
which is exact (a float16 scale times an integer of at most 8 bits); GGUF's
Q4_1 gives its block's min as the offset. A format's method reads its
checkpoint tensors as they are stored (so tensor parallelism shards them along
the checkpoint's own axes) and, once they are loaded, hands them here as
`IntGroups.from_codes(codes, groups, scale, bits, zero=...)` or `offset=...`:
the codes unpacked, one byte each, only for the time of that call. The layer
then keeps only this packed form, about bits/8 bytes a weight plus 4 bytes per
group and output feature, and runs on `IntGroupsLinear`.

Layout (what `native/qlinear.c` reads; it says why):
- output features in tiles of 16 (the last one padded with zero codes);
- input features in "positions": group order, each run of one group padded
  with zero codes to a multiple of 8. `bounds` int32 [groups + 1]: where each
  group's positions start. A checkpoint whose groups are not runs of
  consecutive k (GPTQ's act-order, `desc_act`; and any rank's slice of one),
  or whose groups need padding, keeps `perm` (the input feature of each
  position, -1 for padding) and its activations are gathered in that order
  per call; groups may then be of different lengths;
- `codes` uint8, per tile and octet of positions, each output feature's codes
  in one 32-bit word: 4 bits [tiles, octets, 16, 4], byte b holding positions
  b (low nibble) and b + 4 (high nibble); 8 bits [tiles, octets, 2, 16, 4],
  the words of positions 0..3 then 4..7;
  6 bits (GGUF's Q5_K and Q6_K, on the CPU): per pair of octets, their low
  nibbles as the 4-bit words, then a word of their top 2 bits
  [tiles, octets / 2, 192] (groups padded to whole pairs of octets);
- `scales`, `offsets` float16 [tiles, groups, 16] (`offsets` holds the zero
  points where `zeros` is set); or, for a GGUF K-quant on the CPU, in two
  levels as the file holds them: int8 [tiles, groups, 16] (`offsets` None
  where the scales' int8s serve both) times `supers` float16
  [tiles, groups / per_super, 2, 16], exact in fp32.

The product: y = sum over groups g of  scale[n,g] * sum_{k in g} x[k] q[n,k]
+ offset[n,g] * sum_{k in g} x[k]. The native kernel computes it from the
codes, either in fp32 (its sums in another order than a dequantized float
matmul, hence a tolerance, tested) or, for bf16 activations, with x quantized
to int16 per block of 32 and integer dot products (int8, llama.cpp's way, was
measured at 4x bf16's own rounding error and dropped: native/qlinear.c). On
CUDA the Triton kernel (triton_qlinear.py) reads the same form. The torch
path dequantizes per call and multiplies.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from folio.kernels import native
from folio.model.layers.quantization.base import LinearMethod

TILE = 16
OCTET = 8         # positions per 32-bit word pair of a tile's codes


@dataclass(eq=False)
class IntGroups:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bounds: torch.Tensor
    perm: Optional[torch.Tensor]
    bits: int
    out_features: int
    in_features: int
    zeros: bool             # offsets holds zero points: offset = -zero * scale
    # two-level scales (a GGUF K-quant's): scales and offsets int8 (offsets
    # None: the scales serve both), each times its super-group's float16 pair
    # in supers [tiles, supers, 2, 16]; per_super groups a super-group
    supers: Optional[torch.Tensor] = None
    per_super: int = 0

    @classmethod
    def from_codes(cls, codes: torch.Tensor, groups: torch.Tensor, scale: torch.Tensor,
                   bits: int, *, zero: Optional[torch.Tensor] = None,
                   offset: Optional[torch.Tensor] = None,
                   supers: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None
                   ) -> "IntGroups":
        """codes [N, K] (integers 0 .. 2^bits - 1), groups [K] (the group of each
        input feature, indexing the columns of scale and of zero or offset
        [N, G]; one of the two). `supers` (with offset): (d [N, G], e [N, G],
        per), where each run of `per` groups shares its d and e and every
        scale is d times an int8 and every offset e times one (a K-quant's),
        held so on the CPU where they are so exactly (else as float16)."""
        if (zero is None) == (offset is None):
            raise ValueError("give one of zero and offset")
        # packed on the CPU, then moved to where the checkpoint tensors were
        device = codes.device
        codes, groups, scale = codes.cpu(), groups.cpu(), scale.cpu()
        zero = None if zero is None else zero.cpu()
        offset = zero if offset is None else offset.cpu()
        if bits not in (4, 6, 8):
            raise ValueError(f"{bits}-bit weights are not supported (4, 6 and 8 are)")
        if bits == 6 and device.type != "cpu":
            bits = 8                    # the 6-bit form is the CPU kernel's only
        n, k = codes.shape
        groups = groups.to(torch.int64)
        if groups.shape != (k,) or scale.shape[0] != n or offset.shape != scale.shape:
            raise ValueError(f"quantized weight of shape {(n, k)} has groups {tuple(groups.shape)}"
                             f", scales {tuple(scale.shape)} and offsets {tuple(offset.shape)}")
        if k and (int(groups.min()) < 0 or int(groups.max()) >= scale.shape[1]):
            raise ValueError(f"group index out of range 0..{scale.shape[1] - 1}")
        if k and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
            raise ValueError(f"weight codes out of range for {bits} bits")
        order = torch.arange(k)
        if k and bool((groups[1:] < groups[:-1]).any()):
            order = torch.sort(groups, stable=True).indices
        # consecutive runs of one group, each padded to whole octets of positions
        # (6 bits: pairs of octets)
        run_groups, lengths = torch.unique_consecutive(groups[order], return_counts=True)
        unit = 2 * OCTET if bits == 6 else OCTET
        padded = (lengths + unit - 1) // unit * unit
        bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        bounds[1:] = torch.cumsum(padded, 0)
        positions = int(bounds[-1])
        feature = torch.full((positions,), -1, dtype=torch.int64)       # -1: padding
        starts = bounds[:-1].to(torch.int64)
        within = torch.arange(k) - torch.repeat_interleave(
            torch.cumsum(lengths, 0) - lengths, lengths)
        feature[torch.repeat_interleave(starts, lengths) + within] = order
        perm = None if positions == k and bool((feature == torch.arange(k)).all()) else feature
        two_level = None
        if (supers is not None and zero is None and perm is None and device.type == "cpu"
                and len(run_groups) == scale.shape[1]):     # every group, in order
            two_level = _two_level(scale, offset, *supers)
        scale, offset = scale[:, run_groups], offset[:, run_groups]
        for t, what in ((scale, "scales"), (offset, "zeros" if zero is not None else "offsets")):
            if two_level is None and (not bool(t.half().isfinite().all())
                                      or not bool(t.isfinite().all())):
                raise ValueError(f"quantized weight {what} are not finite float16 numbers")
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        placed = torch.zeros(tiles * TILE, positions, dtype=torch.uint8)
        if perm is None:
            placed[:n] = codes
        else:
            real = feature >= 0
            placed[:n, real] = codes[:, feature[real]].to(torch.uint8)
        octets = placed.view(tiles, TILE, positions // OCTET, OCTET)
        if bits == 4:       # byte b of a word: positions b and b + 4 of the octet
            words = octets[..., :4] | (octets[..., 4:] << 4)              # [t, 16, o, 4]
            packed = words.permute(0, 2, 1, 3)                            # [t, o, 16, 4]
        elif bits == 6:     # per pair of octets: their low nibbles as 4 bits, then
            pairs = octets.view(tiles, TILE, -1, 2, OCTET)               # their top 2 bits
            low = (pairs[..., :4] & 0xF) | ((pairs[..., 4:] & 0xF) << 4)  # [t, 16, o/2, 2, 4]
            top = pairs >> 4
            high = (top[..., 0, :4] | (top[..., 0, 4:] << 2) | (top[..., 1, :4] << 4)
                    | (top[..., 1, 4:] << 6))                             # [t, 16, o/2, 4]
            packed = torch.cat([low.permute(0, 2, 3, 1, 4).reshape(tiles, -1, 128),
                                high.permute(0, 2, 1, 3).reshape(tiles, -1, 64)], dim=-1)
        else:               # the words of positions 0..3, then 4..7
            packed = octets.view(tiles, TILE, -1, 2, 4).permute(0, 2, 3, 1, 4)
        as_tiles = lambda t, dtype=torch.float16: F.pad(t.float(), (0, 0, 0, pad)).to(
            dtype).view(tiles, TILE, -1).transpose(1, 2).contiguous()      # [tiles, G, 16]
        if two_level is not None:
            sc, om, d, e, per = two_level
            held = torch.stack([as_tiles(d), as_tiles(e)], dim=2)          # [tiles, S, 2, 16]
            return cls(packed.contiguous(), as_tiles(sc, torch.int8),
                       None if om is None else as_tiles(om, torch.int8), bounds, perm, bits,
                       n, k, False, held.contiguous(), per).to(device)
        return cls(packed.contiguous(), as_tiles(scale), as_tiles(offset), bounds,
                   perm, bits, n, k, zero is not None).to(device)

    def to(self, device) -> "IntGroups":
        """The same weights with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)
        return dataclasses.replace(self, codes=move(self.codes), scales=move(self.scales),
                                   offsets=move(self.offsets), bounds=move(self.bounds),
                                   perm=move(self.perm), supers=move(self.supers))

    @property
    def positions(self) -> int:
        """Input features in the packed order, padding included."""
        return int(self.bounds[-1])

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """What the native kernel reads, once: (perm, codes, bits, scales,
        offsets, zeros, supers, per_super, bounds, groups) and (n, positions)
        (the tensors never move)."""
        ptr = lambda t: None if t is None else t.data_ptr()
        return ((ptr(self.perm), ptr(self.codes), self.bits, ptr(self.scales),
                 ptr(self.offsets), int(self.zeros), ptr(self.supers), self.per_super,
                 ptr(self.bounds), self.bounds.numel() - 1),
                (self.out_features, self.positions))

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.offsets, self.bounds, self.perm, self.supers)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def unpacked_codes(self) -> torch.Tensor:
        """[tiles * 16, positions] uint8, in the packed order."""
        rows = torch.arange(self.codes.shape[0] * TILE, device=self.codes.device)
        return self._codes(rows // TILE, rows % TILE)

    def _codes(self, tile: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
        """The codes of output features (tile, lane) [R]: [R, positions] uint8."""
        if self.bits == 4:
            words = self.codes[tile, :, lane]                            # [R, o, 4]
            codes = torch.cat([words & 0xF, words >> 4], dim=-1)
        elif self.bits == 6:
            t, pairs = self.codes.shape[:2]
            low = self.codes[..., :128].view(t, pairs, 2, TILE, 4)[tile, :, :, lane]
            high = self.codes[..., 128:].view(t, pairs, TILE, 4)[tile, :, lane]  # [R, o/2, 4]
            tops = [(high >> s) & 3 for s in (0, 2, 4, 6)]
            codes = torch.stack([torch.cat([(low[:, :, h] & 0xF) | (tops[2 * h] << 4),
                                            (low[:, :, h] >> 4) | (tops[2 * h + 1] << 4)], -1)
                                 for h in range(2)], dim=2)               # [R, o/2, 2, 8]
        else:
            codes = self.codes[tile, :, :, lane]                         # [R, o, 2, 4]
        return codes.reshape(len(tile), self.positions)

    def _scale_offset(self, tile: torch.Tensor, lane: torch.Tensor):
        """Each group's scale and offset, fp32 [R, G], of output features (tile, lane)."""
        scale, offset = self.scales[tile, :, lane], (
            self.scales if self.offsets is None else self.offsets)[tile, :, lane]
        if self.supers is None:
            scale, offset = scale.float(), offset.float()
            return scale, -offset * scale if self.zeros else offset
        sup = torch.arange(scale.shape[1], device=scale.device) // self.per_super
        pair = self.supers[tile, :, :, lane].float()[:, sup]             # [R, G, 2]
        return scale.float() * pair[..., 0], offset.float() * pair[..., 1]

    @functools.cached_property
    def _group_of_position(self) -> torch.Tensor:
        """[positions]: each position's group (an embedding lookup's every
        step asked for it anew: a repeat_interleave, most of a one-token
        lookup's time)."""
        lengths = (self.bounds[1:] - self.bounds[:-1]).to(torch.int64)
        return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device),
                                       lengths)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the checkpoint's order of k."""
        return self.dequantize_rows(None, dtype)

    def dequantize_rows(self, rows: Optional[torch.Tensor],
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Output features `rows` (any shape of indices; None: all) of the float
        weight: [*rows.shape, K] (an embedding table's lookup)."""
        per_position = self._group_of_position
        flat = (torch.arange(self.out_features, device=self.codes.device) if rows is None
                else rows.reshape(-1))
        tile, lane = flat // TILE, flat % TILE
        codes = self._codes(tile, lane)
        scale, offset = self._scale_offset(tile, lane)
        scale, offset = scale[:, per_position], offset[:, per_position]
        w = codes.float() * scale + offset
        if self.perm is not None:
            real = self.perm >= 0
            out = torch.empty(w.shape[0], self.in_features, device=w.device)
            out[:, self.perm[real]] = w[:, real]
            w = out
        w = w.to(dtype)
        return w if rows is None else w.view(*rows.shape, self.in_features)


@dataclass(eq=False)
class RowParts:
    """A layer's output features in runs held in different forms, each an
    IntGroups (a fused GGUF layer whose projections are of different types:
    Q4_K_M's Q4_K q and k beside a Q6_K v, llama.cpp's Mixtral files' Q4_K q
    beside Q8_0 k and v), so that each keeps its file's size; the product is
    the parts' side by side."""
    parts: list[IntGroups]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def bits(self) -> int:
        return max(p.bits for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device) -> "RowParts":
        return RowParts([p.to(device) for p in self.parts])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def _two_level(scale, offset, d, e, per):
    """(scales, offsets or None, d, e, per) as IntGroups holds them: int8
    [N, G] such that scale = int8 * d and offset = int8 * e exactly in fp32,
    d and e [N, S] float16 (one a run of `per` groups), offsets None where
    they equal the scales; or None where the values are not so."""
    n, g = scale.shape
    if per < 1 or per & (per - 1) or g % per or d.shape != scale.shape or e.shape != scale.shape:
        return None                 # (the kernel's super-groups are a power of two groups)
    d, e = d.float().view(n, g // per, per), e.float().view(n, g // per, per)
    if not (bool((d == d[..., :1]).all()) and bool((e == e[..., :1]).all())):
        return None
    d, e = d[..., 0], e[..., 0]
    if not (bool((d.half().float() == d).all()) and bool((e.half().float() == e).all())):
        return None

    def steps(values, mult):
        m = mult.repeat_interleave(per, dim=1)
        q = torch.where(m != 0, torch.round(values / torch.where(m != 0, m, 1.0)),
                        torch.zeros_like(values))
        ok = bool(((q >= -128) & (q <= 127)).all()) and bool((q * m == values).all())
        return q if ok else None

    sc, om = steps(scale.float(), d), steps(offset.float(), e)
    if sc is None or om is None:
        return None
    return sc, None if torch.equal(sc, om) else om, d, e, per


class IntGroupsLinear(LinearMethod):
    """A layer whose weights are `IntGroups`: on CUDA the Triton kernel
    (triton_qlinear.py), on the CPU the native one where the CPU has it, else
    dequantized per call (the reference both kernels are tested against)."""

    native_kind = "int"     # the one-call decoder runs these (native/decoder.py)
    # the native kernel's int8 activations at decode batch sizes (else fp32
    # arithmetic, int16 for bf16): set_activation_quantization
    int8 = True

    def __init__(self, weights: IntGroups):
        self.weights = weights

    def quantize_x(self, dtype: torch.dtype) -> int:
        """native.qlinear's mode for activations of `dtype`."""
        return native.QLINEAR_INT8_AT_FEW_ROWS if self.int8 else int(dtype == torch.bfloat16)

    def native_weight(self) -> IntGroups:
        return self.weights

    def apply(self, layer, x, bias=None):
        w = self.weights
        if isinstance(w, RowParts):     # each run of output features in its own form
            outs, first = [], 0
            for part in w.parts:
                end = first + part.out_features
                outs.append(self._product(part, x, None if bias is None else bias[first:end]))
                first = end
            return torch.cat(outs, dim=-1)
        return self._product(w, x, bias)

    def _product(self, w: IntGroups, x: torch.Tensor, bias) -> torch.Tensor:
        if x.is_cuda and has_triton():
            from folio.kernels.triton_qlinear import qlinear
            return qlinear(x, w, bias)
        if native.runs_qlinear(x):
            return native.qlinear(x, w, bias, quantize_x=self.quantize_x(x.dtype))
        return F.linear(x, w.dequantize(x.dtype), bias)


@functools.cache
def has_triton() -> bool:
    """Whether triton (the CUDA kernels' compiler) is installed."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def set_activation_quantization(model: torch.nn.Module, mode: str) -> None:
    """--activation-quantization for every quantized layer of `model`: "int8"
    or "none" (config.ACTIVATION_QUANTIZATIONS)."""
    for module in model.modules():
        methods = [getattr(module, "quant_method", None)]
        methods += [m for pair in getattr(module, "packed_experts", None) or () for m in pair]
        for method in methods:           # a layer's, and a MoE layer's experts'
            if isinstance(method, IntGroupsLinear):
                method.int8 = mode == "int8"
