"""GGUF's Q4_0, Q4_1, Q8_0 and K-quant (Q4_K, Q5_K, Q6_K) linear weights,
kept in their blocks' codes.

A legacy block is 32 consecutive input features of one output row: a float16
scale d (and for Q4_1 a float16 min m) and 32 codes. Q4_0: w = (q - 8) d;
Q4_1: w = q d + m; Q8_0: w = q d with q a signed byte. A K-quant super-block
is 256 input features in sub-blocks, each with its own integer scale (and
min) under the super-block's float16 d (and dmin): Q4_K and Q5_K, 8
sub-blocks of 32 with 6-bit scales sc and mins m, w = q d sc - dmin m with
4- and 5-bit q; Q6_K, 16 sub-blocks of 16 with int8 scales, w = d sc (q -
32) with 6-bit q. The loader (`model/gguf_loader.py`) splits each packed
tensor into checkpoint tensors the layers' loader can shard like any other
(rows are output features; blocks run along the input):

- `qcodes` uint8 [out, in / (8 // bits)]: unsigned codes (`KINDS` gives
  each type's bits), for 4 bits two per byte, input feature 2j in the low
  nibble of byte j and 2j + 1 in the high one, else one per byte (Q8_0's
  signed bytes offset by 128; Q5_K's and Q6_K's 5- and 6-bit codes);
- `qscales` [out, in / group]: d, or a K-quant sub-block's d sc;
- `qoffsets` [out, in / group]: -8 d, m, -128 d, -dmin m or -32 d sc;
- K-quants: `qsuperscales` and `qsuperoffsets` [out, in / group], each
  group's super-block's d and -dmin (Q6_K: -32 d).

So w = q * scale + offset for all of them, as the gguf package dequantizes
them (its products and sums are exact in fp32). The legacy types' scales and
offsets are held in float16 (exact: their d and m are float16). A K-quant's
are held as the file holds them: the sub-blocks' integers as int8 (sc, and m;
Q6_K's one sc serves both) and per super-block the float16 d and offset
multiplier, the kernel's products of the two exact in fp32
(`IntGroups.from_codes(supers=...)`; where a tensor-parallel rank's inputs
are not whole super-blocks of 256, float16 ones); Q5_K's and Q6_K's codes
in 6 bits. A layer that mixes a K-quant with a legacy type (llama.cpp's
Mixtral files keep attn_k and attn_v Q8_0) holds float16 scales.
A fused layer whose projections are of different types loads its tensors
in one form (`held_form`) and, once loaded, holds each run of rows of one
form in its own (RowParts: Q4_K_M's Q4_K q and k in 4 bits, its Q6_K v in
6). So a Q4_K_M file is held at about its size (1.02x): Q4_K at 4.63 bits
a weight (the file's 4.5), Q6_K at 6.63 (the file's 6.56). A MoE layer's stacked experts are kept so too,
each expert's gate and up (one form) and down a packed form of their own
(`expert_methods`, read by layers/moe.py). Which tensors are
kept packed is decided once, when the config is read
(`gguf_loader.packed_linear_tensors`: a fused layer's projections must share
one packable type); the others (Q2_K, Q3_K, ...) are dequantized to float at
load and run as plain weights. The embedding table (`token_embd`,
often Q8_0) is kept in its codes the same way: the embedding dequantizes the
rows it looks up and a tied LM head multiplies by the same packed form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from folio.model.layers.linear import PlainLinearMethod
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.int_checkpoint import IntCheckpointMethod
from folio.model.layers.quantization.int_groups import IntGroups, RowParts

# the types kept packed: (bits of the codes as held, input features per group)
KINDS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32),
         "Q4_K": (4, 32), "Q5_K": (6, 32), "Q6_K": (6, 16)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")     # scales in two levels: int8s under a super-block's d


def held_form(kinds) -> tuple[int, int]:
    """(bits, group) a layer of these parts is loaded in: one form for the
    fused layer's checkpoint tensors, the widest codes and the smallest groups
    among them (a Q4_K part beside a Q6_K one, as Q4_K_M's attn_v is, loads in
    6 bits and groups of 16, each group of 32's scale twice); once loaded,
    each run of parts of one form is held in its own (RowParts: the Q4_K rows
    in 4 bits and groups of 32, the Q6_K rows in 6 bits and groups of 16)."""
    return max(KINDS[k][0] for k in kinds), min(KINDS[k][1] for k in kinds)


def two_level(kinds) -> bool:
    """Whether a layer of these parts holds its scales in two levels (every
    part a K-quant; a fused layer of a K-quant beside a legacy type, as
    llama.cpp's Mixtral files' Q4_K q beside Q8_0 k and v, holds float16 ones)."""
    return all(k in K_QUANTS for k in kinds)


# our fused projections -> the checkpoint projections they hold
# (w1_w3: a Mixtral expert's gate and up, layers/moe.py's checkpoint experts)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "w1_w3": ("w1", "w3")}


def shard_names(prefix: str) -> list[str]:
    """The checkpoint weights a layer named `prefix` is loaded from."""
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{part}.weight" if parent else f"{part}.weight"
            for part in FUSED.get(leaf, (leaf,))]


@register_quantization("gguf")
class GGUFConfig(QuantizationConfig):
    """config: {"packed": {HF weight name: GGUF type}} for the tensors kept packed."""

    def __init__(self, config: dict[str, Any], *, weight_dtype=None):
        super().__init__(config, weight_dtype=weight_dtype)
        self.packed = dict(config.get("packed") or {})
        unknown = sorted(set(self.packed.values()) - set(KINDS))
        if unknown:
            raise ValueError(f"GGUF tensor types {', '.join(unknown)} cannot run packed; "
                             f"packed: {', '.join(KINDS)}")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        kinds = [self.packed.get(name) for name in shard_names(prefix)]
        if None not in kinds:
            return GGUFLinearMethod(kinds, prefix)
        return PlainLinearMethod(self.weight_dtype)

    def expert_methods(self, layer_prefix: str):
        """A MoE layer's (gate and up, down) methods where its stacked experts
        (`{layer_prefix}.mlp.experts.{gate,up,down}.weight`) are kept packed,
        else None."""
        kinds = [self.packed.get(f"{layer_prefix}.mlp.experts.{p}.weight")
                 for p in ("gate", "up", "down")]
        if None in kinds:
            return None
        return (GGUFLinearMethod(kinds[:2], f"{layer_prefix}.mlp.experts.gate_up"),
                GGUFLinearMethod(kinds[2:], f"{layer_prefix}.mlp.experts.down"))

    def get_embedding_method(self, layer: nn.Module, prefix: str):
        """`token_embd` (and an untied `output`) of a packable type: rows of
        the table are output features, its blocks run along the hidden size."""
        kind = self.packed.get(f"{prefix}.weight")
        return None if kind is None else GGUFLinearMethod([kind], prefix)


class GGUFLinearMethod(IntCheckpointMethod):
    """Offsets rather than zero points: its own `dequantize` and `int_groups`."""

    def __init__(self, kinds: list[str], prefix: str):
        self.kinds = list(kinds)
        self.kind, self.prefix = "+".join(dict.fromkeys(kinds)), prefix
        self.bits, self.group = held_form(kinds)
        self.two_level = two_level(kinds)
        self.checkpoint_tensors = ("qcodes", "qscales", "qoffsets") + (
            ("qsuperscales", "qsuperoffsets") if self.two_level else ())

    def create_weights(self, layer, in_features, out_features, dtype):
        if in_features % self.group:
            raise ValueError(f"{self.prefix}: {in_features} input features per rank do not "
                             f"split into {self.kind}'s groups of {self.group}")
        per_byte = 8 // self.bits
        weight_param(layer, "qcodes", (out_features, in_features // per_byte), torch.uint8,
                     output_dim=0, input_dim=1, packed_dim=1, pack_factor=per_byte)
        for name in self.checkpoint_tensors[1:]:
            weight_param(layer, name, (out_features, in_features // self.group),
                         torch.float32, output_dim=0, input_dim=1)

    def _codes(self, layer) -> torch.Tensor:
        return self._unpacked(layer.qcodes.data)

    def _unpacked(self, codes: torch.Tensor) -> torch.Tensor:
        """The loaded codes one a byte (4-bit ones are loaded two a byte)."""
        if self.bits == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
        return codes

    def dequantize(self, layer) -> torch.Tensor:
        """The checkpoint's values, in fp32 (before the packed form's float16)."""
        groups = torch.arange(self._codes(layer).shape[1]) // self.group
        return (self._codes(layer).float() * layer.qscales.data[:, groups]
                + layer.qoffsets.data[:, groups])

    def int_groups(self, layer):
        tensors = {name: getattr(layer, name).data for name in self.checkpoint_tensors}
        runs = self._runs(layer)
        if runs is None:
            return self.held(tensors)
        return RowParts([self._held_rows(tensors, first, last, kind)
                         for first, last, kind in runs])

    def _runs(self, layer) -> "list[tuple[int, int, str]] | None":
        """A fused layer's runs of output features (this rank's) whose parts
        are held in one form: (first, end, a kind of the run); None where the
        whole layer is one run."""
        if len({held_form([k]) for k in self.kinds}) < 2:
            return None
        if hasattr(layer, "output_sizes"):                          # gate, up
            sizes = list(layer.output_sizes)
        else:                                                       # q, k, v
            q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            sizes = [q, kv, kv]
        runs, first = [], 0
        for size, kind in zip(sizes, self.kinds):
            if runs and held_form([runs[-1][2]]) == held_form([kind]):
                runs[-1] = (runs[-1][0], first + size, runs[-1][2])
            else:
                runs.append((first, first + size, kind))
            first += size
        return runs

    def _held_rows(self, tensors: dict, first: int, end: int, kind: str) -> IntGroups:
        """Output features first .. end - 1 of the loaded tensors (held in the
        fused layer's common form: its widest codes, its smallest groups) in
        `kind`'s own form: its bits, its groups (every group of the common
        form's `step` the same scale, as loaded), two levels where the
        layer's are."""
        bits, group = KINDS[kind]
        step = group // self.group
        codes = self._unpacked(tensors["qcodes"][first:end])
        rows = {t: v[first:end] for t, v in tensors.items() if t != "qcodes"}
        if any(not torch.equal(v, v[:, ::step].repeat_interleave(step, 1))
               for v in rows.values()):
            raise ValueError(f"{self.prefix}: {kind} scales differ within its groups of "
                             f"{group}")
        rows = {t: v[:, ::step] for t, v in rows.items()}
        groups = torch.arange(codes.shape[1]) // group
        supers = None
        if self.two_level:
            supers = (rows["qsuperscales"], rows["qsuperoffsets"], 256 // group)
        return IntGroups.from_codes(codes, groups, rows["qscales"], bits,
                                    offset=rows["qoffsets"], supers=supers)

    def held(self, tensors: dict[str, torch.Tensor]) -> IntGroups:
        """The packed form of one matrix's loaded tensors (`checkpoint_tensors`
        by name; a layer's, or one expert's of a MoE layer)."""
        codes = self._unpacked(tensors["qcodes"])
        groups = torch.arange(codes.shape[1]) // self.group
        supers = None
        if self.two_level:      # held so where a rank's inputs are whole super-blocks
            supers = (tensors["qsuperscales"], tensors["qsuperoffsets"], 256 // self.group)
        return IntGroups.from_codes(codes, groups, tensors["qscales"], self.bits,
                                    offset=tensors["qoffsets"], supers=supers)
