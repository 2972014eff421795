"""Tensor- and pipeline-parallel ranks and collectives.

At world size 1 every collective is the identity, so layers are written once,
as the parallel ones. With pipeline parallelism (P stages of T ranks) global
rank r is stage r // T, tensor-parallel rank r % T; each stage's T ranks
form their own group, which the layers' collectives use.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None            # the stage's tensor-parallel group (None: the whole world)
_PP_RANK = 0
_PP_SIZE = 1
_PP_BACK_GROUP = None       # the last stage's results back to stage 0 (a pair of ranks)


def set_tensor_parallel(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def set_pipeline_parallel(rank: int, size: int) -> None:
    global _PP_RANK, _PP_SIZE
    _PP_RANK, _PP_SIZE = rank, size


def set_tensor_parallel_group(group) -> None:
    """The group the layers' collectives run in (kept after set_tensor_parallel
    goes back to 1: layers built for a split keep using it)."""
    global _TP_GROUP
    _TP_GROUP = group


def set_pipeline_back_group(group) -> None:
    global _PP_BACK_GROUP
    _PP_BACK_GROUP = group


def pipeline_back_group():
    """This rank's group with its counterpart at the other end of the pipe
    (stage 0 and the last stage), for the final hidden states: a channel of
    its own, so that on NCCL (one stream per pair of ranks, in order) they
    never queue behind the activations going the other way."""
    return _PP_BACK_GROUP


def pp_rank() -> int:
    return _PP_RANK


def pp_size() -> int:
    return _PP_SIZE


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sum over the `size` ranks the calling layer was built for (layers keep
    their own size, so a second, unsharded model in the process is unaffected)."""
    if size == 1:
        return x
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)
