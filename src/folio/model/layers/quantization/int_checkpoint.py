"""The method of a checkpoint format whose tensors are integer codes with a
scale and zero point per group (GPTQ, AWQ, compressed-tensors; GGUF with
offsets), and the helpers those formats share: the int32 words codes are
packed in, the checks of their shapes, and the hand-over of a loaded layer
to `IntGroupsLinear` on the packed form (int_groups.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from folio.model.layers.quantization.base import LinearMethod
from folio.model.layers.quantization.int_groups import IntGroups, IntGroupsLinear


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


def check_input_groups(where: str, group: int, in_features: int, full_in: int, *,
                       whole_on_each_rank: bool = True) -> None:
    """Refuse a group size that does not divide a layer's `full_in` input
    features, or (`whole_on_each_rank`) that a row-parallel rank's
    `in_features` of them do not hold whole groups of. `where`: the layer
    and format the messages name."""
    if full_in % group:
        raise ValueError(f"{where} group_size {group} does not divide the layer's "
                         f"{full_in} input features")
    if whole_on_each_rank and in_features % group:
        raise ValueError(f"{where} group_size {group}: each of the {full_in // in_features} "
                         f"tensor-parallel ranks gets {in_features} of the layer's "
                         f"{full_in} input features, not whole groups")


def check_packs(where: str, bits: int, features: int, what: str) -> None:
    """Refuse `features` (`what`: input or output) that do not fill whole
    int32 words of `bits`-bit codes."""
    per = 32 // bits
    if features % per:
        raise ValueError(f"{where} {bits}-bit packs {per} {what} features per int32; "
                         f"{features} is not a multiple")


class IntCheckpointMethod(LinearMethod):
    """The method of a format whose checkpoint stores `bits`-bit integer codes
    and a scale and zero point per group (GPTQ, AWQ, compressed-tensors): it
    reads the tensors as stored and, once they are loaded, hands the layer
    over to `IntGroupsLinear`.

    A subclass creates the tensors (`create_weights`), names them in
    `checkpoint_tensors` (emptied by the hand-over) and reads them back in
    `_parts`. A format with offsets rather than zero points (GGUF) overrides
    `dequantize` and `int_groups`."""

    bits: int
    checkpoint_tensors: tuple[str, ...] = ()

    def _parts(self, layer) -> tuple[torch.Tensor, ...]:
        """(codes [N, K], group of each k [K], scale [N, G], zero [N, G])."""
        raise NotImplementedError

    def dequantize(self, layer) -> torch.Tensor:
        """The float weight [N, K] straight from the checkpoint tensors (the
        reference the packed form is tested against)."""
        codes, groups, scale, zero = self._parts(layer)
        return (codes.float() - zero[:, groups]) * scale[:, groups]

    def int_groups(self, layer) -> IntGroups:
        """The packed form of the loaded checkpoint tensors."""
        codes, groups, scale, zero = self._parts(layer)
        return IntGroups.from_codes(codes, groups, scale, self.bits, zero=zero)

    def process_weights_after_loading(self, layer):
        hand_over(layer, self.int_groups(layer), *self.checkpoint_tensors)

    def apply(self, layer, x, bias=None):
        # only before the weights are processed (the layer is handed over then)
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)
