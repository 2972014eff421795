"""Tensor-parallel rank and collectives.

At world size 1 every collective is the identity, so layers are written once,
as the parallel ones.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sum over the `size` ranks the calling layer was built for (layers keep
    their own size, so a second, unsharded model in the process is unaffected)."""
    if size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
