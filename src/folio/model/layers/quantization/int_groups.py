"""One packed form for every 4- and 8-bit weight format, and the method that
runs it.

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

Layout (what `native/qlinear.c` reads):
- output features in tiles of 16 (the last one padded with zero codes);
- `codes` uint8 [tiles, K, 8] for 4 bits (byte j of (tile, k) holds the
  codes of features j and j + 8 of the tile, low and high nibble) or
  [tiles, K, 16] for 8 bits: one tile's column k is one 8- or 16-byte load;
- `scales`, `offsets` float16 [tiles, groups, 16] (`offsets` holds the zero
  points where `zeros` is set);
- input features in group order: `bounds` int32 [groups + 1] gives where each
  group starts. A checkpoint whose groups are not runs of consecutive k
  (GPTQ's act-order, `desc_act`; and any rank's slice of one) is permuted once
  here (`perm`, the k of each position) and its activations gathered in that
  order per call; groups may then be of different lengths.

The product: y = sum over groups g of  scale[n,g] * sum_{k in g} x[k] q[n,k]
+ offset[n,g] * sum_{k in g} x[k]; the native kernel computes it in fp32 from
the codes (its sums in another order than a dequantized float matmul, hence a
tolerance, tested), the torch path dequantizes per call and multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from folio.model import native
from folio.model.layers.quantization.base import LinearMethod

TILE = 16


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

    @classmethod
    def from_codes(cls, codes: torch.Tensor, groups: torch.Tensor, scale: torch.Tensor,
                   bits: int, *, zero: Optional[torch.Tensor] = None,
                   offset: Optional[torch.Tensor] = None) -> "IntGroups":
        """codes [N, K] (integers 0 .. 2^bits - 1), groups [K] (the group of each
        input feature, indexing the columns of scale and of zero or offset
        [N, G]; one of the two)."""
        if (zero is None) == (offset is None):
            raise ValueError("give one of zero and offset")
        offset = zero if offset is None else offset
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit weights are not supported (4 and 8 are)")
        n, k = codes.shape
        groups = groups.to(torch.int64)
        if groups.shape != (k,) or scale.shape[0] != n or offset.shape != scale.shape:
            raise ValueError(f"quantized weight of shape {(n, k)} has groups {tuple(groups.shape)}"
                             f", scales {tuple(scale.shape)} and offsets {tuple(offset.shape)}")
        if k and (int(groups.min()) < 0 or int(groups.max()) >= scale.shape[1]):
            raise ValueError(f"group index out of range 0..{scale.shape[1] - 1}")
        if k and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
            raise ValueError(f"weight codes out of range for {bits} bits")
        perm = None
        if k and bool((groups[1:] < groups[:-1]).any()):
            perm = torch.sort(groups, stable=True).indices
            codes, groups = codes[:, perm], groups[perm]
        # consecutive runs of one group -> bounds; their scales in run order
        run_groups, lengths = torch.unique_consecutive(groups, return_counts=True)
        bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        bounds[1:] = torch.cumsum(lengths, 0)
        scale, offset = scale[:, run_groups], offset[:, run_groups]
        for t, what in ((scale, "scales"), (offset, "zeros" if zero is not None else "offsets")):
            if not bool(t.half().isfinite().all()) or not bool(t.isfinite().all()):
                raise ValueError(f"quantized weight {what} are not finite float16 numbers")
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        codes = F.pad(codes.to(torch.uint8), (0, 0, 0, pad))
        tiled = codes.view(tiles, TILE, k).transpose(1, 2)                 # [tiles, K, 16]
        if bits == 4:
            tiled = tiled[..., :8] | (tiled[..., 8:] << 4)
        as_tiles = lambda t: F.pad(t.float(), (0, 0, 0, pad)).to(torch.float16).view(
            tiles, TILE, -1).transpose(1, 2).contiguous()                 # [tiles, G, 16]
        return cls(tiled.contiguous(), as_tiles(scale), as_tiles(offset), bounds,
                   perm, bits, n, k, zero is not None)

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.offsets, self.bounds, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def unpacked_codes(self) -> torch.Tensor:
        """[tiles * 16, K] uint8, in the packed (group) order of k."""
        c = self.codes
        if self.bits == 4:
            c = torch.cat([c & 0xF, c >> 4], dim=-1)
        return c.transpose(1, 2).reshape(-1, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the checkpoint's order of k."""
        lengths = (self.bounds[1:] - self.bounds[:-1]).to(torch.int64)
        per_k = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        spread = lambda t: t.float().transpose(1, 2).reshape(-1, t.shape[1])[:, per_k]
        scale, offset = spread(self.scales), spread(self.offsets)
        if self.zeros:
            offset = -offset * scale
        w = self.unpacked_codes().float() * scale + offset
        w = w[:self.out_features]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)


class IntGroupsLinear(LinearMethod):
    """A layer whose weights are `IntGroups`: the native kernel where the CPU
    has one, else dequantized per call (the reference the kernel is tested
    against)."""

    native_kind = None      # the one-call decoder does not run these layers (yet)

    def __init__(self, weights: IntGroups):
        self.weights = weights

    def apply(self, layer, x, bias=None):
        w = self.weights
        if native.runs_qlinear(x):
            return native.qlinear(x, w, bias)
        return F.linear(x, w.dequantize(x.dtype), bias)


def hand_over(layer, weights: IntGroups, *names: str) -> None:
    """Make `layer` run on `weights`, emptying its checkpoint tensors `names`
    (the parameters stay, for their names)."""
    layer.quant_method = IntGroupsLinear(weights)
    for name in names:
        param = getattr(layer, name)
        param.data = torch.empty(0, dtype=param.dtype)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words holding 32/bits codes each, lowest bits first, along `dim`
    -> the codes (int32), that axis 32/bits times longer. `order`: the
    position in its group of 32/bits of the code in the i-th bits of a word
    (AWQ's interleave), else i."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(-1)
    codes = torch.bitwise_and(torch.bitwise_right_shift(p.movedim(dim, -2), shifts),
                              (1 << bits) - 1)                        # [..., words, per]
    if order is not None:
        codes = codes[..., torch.argsort(torch.tensor(order))]
    codes = codes.flatten(-2)
    return codes.movedim(-1, dim)
