"""LoRA on the model's linear layers, several adapters in one step (issue 31).

Each adapted layer holds `max_loras` slots of stacked weights:

    a  [slots, parts * R, in]    every part's A, rank zero-padded to R
    b  [slots, out, parts * R]   every part's B times the scaling, in its
                                 part's output rows and its rank's columns

where a fused layer's parts are its checkpoint projections (qkv: q, k, v;
gate_up: gate, up) and R is --max-lora-rank. A step's tokens are grouped by
the slot of their sequence's adapter (`LoRAContext.groups`, set by the
runner before the forward); each group adds (x A^T) B^T to the layer's
output, shrink then expand, each slot's weights read once per step
(`add_lora`); tokens of no adapter add nothing. `reference_lora` is the
per-token loop the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from folio.model.lora.checkpoint import LoRAAdapter, LoRAWeights


@dataclass
class LoRAContext:
    """The step's token groups: (slot, row indices) for each adapter that has
    tokens in it; shared by every adapted layer of the model."""
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """y [T, out] plus, for each group's rows, (x A_slot^T) B_slot^T."""
    for slot, rows in groups:
        xs = x.index_select(0, rows)
        y.index_add_(0, rows, (xs @ a[slot].t().to(xs.dtype)) @ b[slot].t().to(xs.dtype))
    return y


def reference_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slots: list[Optional[int]]) -> torch.Tensor:
    """The per-token delta: row i gets B_s (A_s x_i), s its slot (None: 0)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype)
    for i, s in enumerate(slots):
        if s is not None:
            out[i] = b[s].to(x.dtype) @ (a[s].to(x.dtype) @ x[i])
    return out


class LoRASlots:
    """One layer's slots. `parts`: (checkpoint leaf, first output row, rows)
    of each projection fused in the layer, in output order."""

    def __init__(self, parts: list[tuple[str, int, int]], in_features: int, out_features: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device,
                 context: LoRAContext):
        self.parts, self.max_rank, self.context = parts, max_rank, context
        width = len(parts) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)

    def set_slot(self, slot: int, modules: dict[str, LoRAWeights], scaling: float) -> None:
        """The slot holds this layer's part of an adapter (`modules`: leaf ->
        weights; a part it does not adapt stays zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, (leaf, first, rows) in enumerate(self.parts):
            w = modules.get(leaf)
            if w is None:
                continue
            r, col = w.rank, i * self.max_rank
            self.a[slot, col:col + r] = w.a.to(self.a.dtype)
            self.b[slot, first:first + rows, col:col + r] = (w.b.float() * scaling).to(
                self.b.dtype)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        groups = self.context.groups
        return add_lora(x, y, self.a, self.b, groups) if groups else y


# each Llama-style layer's adapted linear layers: (path in the decoder layer,
# its parts' checkpoint leaves)
ADAPTED = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("self_attn.o_proj", ("o_proj",)),
           ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
           ("mlp.down_proj", ("down_proj",)))


def _module(layer, path: str):
    for name in path.split("."):
        layer = getattr(layer, name, None)
        if layer is None:
            return None
    return layer


def attach_lora(model, max_loras: int, max_rank: int, dtype: torch.dtype,
                device) -> tuple[LoRAContext, dict[str, LoRASlots]]:
    """Slots on every adapted linear layer of the model's decoder layers (a
    layer without a dense MLP, a mixture of experts', keeps its attention's).
    Returns the shared context and the slots by checkpoint module prefix
    (`model.layers.{i}.self_attn`, with the part's leaf added at load)."""
    context = LoRAContext()
    slots: dict[str, LoRASlots] = {}
    for i, layer in enumerate(model.model.layers):
        for path, leaves in ADAPTED:
            linear = _module(layer, path)
            if linear is None:
                continue
            sizes = _part_rows(linear, leaves)
            parts, first = [], 0
            for leaf, rows in zip(leaves, sizes):
                parts.append((leaf, first, rows))
                first += rows
            linear.lora = LoRASlots(parts, linear.in_features, linear.out_features, max_loras,
                                    max_rank, dtype, device, context)
            block = path.split(".")[0]
            for leaf in leaves:
                slots[f"model.layers.{i}.{block}.{leaf}"] = linear.lora
    return context, slots


def _part_rows(linear, leaves) -> list[int]:
    """Output rows of each part of a (single-rank) fused layer."""
    if len(leaves) == 1:
        return [linear.out_features]
    if len(leaves) == 3:            # q, k, v
        d = linear.head_dim
        return [linear.num_heads * d, linear.num_kv_heads * d, linear.num_kv_heads * d]
    return [linear.out_features // 2] * 2


def load_into_slot(slots: dict[str, LoRASlots], slot: int, adapter: LoRAAdapter) -> None:
    """An adapter into `slot` of every adapted layer (the layers it does not
    adapt get zeros there)."""
    by_layer: dict[int, dict[str, LoRAWeights]] = {}
    for module, w in adapter.modules.items():
        if module not in slots:
            raise ValueError(f"LoRA adapter {adapter.name!r}: module {module} is not an adapted "
                             "layer of this model (a mixture of experts' MLP?)")
        by_layer.setdefault(id(slots[module]), {})[module.rsplit(".", 1)[-1]] = w
    for layer_slots in {id(s): s for s in slots.values()}.values():
        layer_slots.set_slot(slot, by_layer.get(id(layer_slots), {}), adapter.scaling)
