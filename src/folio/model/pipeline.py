"""A pipeline stage's share of a model (--pipeline-parallel-size P).

The decoder layers are split into P contiguous runs, as even as they go (the
first stages take one more when they do not divide). Stage 0 also holds the
embedding and the LM head (with tied embeddings they are one tensor, and the
logits are computed where the sampler's state lives); the last stage holds
the final norm. A layer another stage runs is a `MissingLayer`: no
parameters, so the loader neither expects nor reads its tensors
(`StagePlan.owns` filters the checkpoint by name before a tensor is read),
and layer i keeps its checkpoint name `model.layers.{i}` on every stage.

At P = 1 the plan is the whole model and nothing here changes a forward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from torch import nn

from folio.distributed.parallel_state import pp_rank, pp_size

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def stage_layers(num_layers: int, rank: int, size: int) -> range:
    """The layers stage `rank` of `size` runs."""
    if not 1 <= size <= num_layers:
        raise ValueError(f"the model's {num_layers} decoder layers cannot be split into "
                         f"pipeline_parallel_size={size} stages (each needs one at least)")
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class MissingLayer(nn.Module):
    """Stands for a layer another pipeline stage runs."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer runs on another pipeline stage")


@dataclass(frozen=True)
class StagePlan:
    rank: int
    size: int
    layers: range

    @classmethod
    def current(cls, num_layers: int) -> "StagePlan":
        """This process's stage (parallel_state), for a model of num_layers."""
        return cls(pp_rank(), pp_size(), stage_layers(num_layers, pp_rank(), pp_size()))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def whole(self) -> bool:
        return self.size == 1

    def module_list(self, num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
        return nn.ModuleList(build(i) if i in self.layers else MissingLayer()
                             for i in range(num_layers))

    def owned(self, layers: nn.ModuleList) -> list[nn.Module]:
        return [layers[i] for i in self.layers]

    def owns(self, name: str) -> bool:
        """Whether this stage loads the checkpoint tensor `name` (HF names)."""
        if self.whole:
            return True
        m = _LAYER.match(name)
        if m is not None:
            return int(m.group(1)) in self.layers
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return self.is_first
        if name.startswith("model.norm."):
            return self.is_last
        return True
