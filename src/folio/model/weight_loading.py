"""One loader for every model: checkpoint tensors into parameters, by name.

A model declares how checkpoint names map onto its fused parameters
(`packed_modules_mapping`, e.g. q/k/v into qkv_proj with shard ids "q", "k",
"v") and which checkpoint tensors it does not read (`ignored_checkpoint_names`,
e.g. a tied LM head); each parameter's `weight_loader` takes its slice. A
parameter stacked from many tensors (a MoE layer's experts) names them itself:
`param.checkpoint_names`, shard id -> checkpoint name. Every
tensor the model expects must come: the error names the missing ones by their
checkpoint names (a checkpoint without `k_proj` is caught even though its
fused `qkv_proj` received q and v).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def _expected(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[tuple, str]:
    """(parameter name, shard id) -> the checkpoint name that fills it."""
    mapping = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name, param in params.items():
        named = getattr(param, "checkpoint_names", None)
        if named is not None:           # filled from several tensors (stacked experts)
            out.update({(name, shard): ckpt for shard, ckpt in named.items()})
            continue
        fused = next((f for f in mapping if f".{f}." in name), None)
        if fused is None:
            out[(name, None)] = name
            continue
        for part, shard in mapping[fused]:
            out[(name, shard)] = name.replace(f".{fused}.", f".{part}.")
    return out


def load_model_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    parts = {f".{part}.": (f".{fused}.", shard)
             for fused, shards in mapping.items() for part, shard in shards}
    ignored = set(getattr(model, "ignored_checkpoint_names", lambda: ())())
    # a parameter that names its checkpoint tensors itself (shard -> name) takes them
    routes = {ckpt: (pname, shard) for pname, p in params.items()
              for shard, ckpt in getattr(p, "checkpoint_names", {}).items()}
    loaded = set()
    for name, tensor in weights:
        if name in ignored:
            continue
        target, shard = routes.get(name, (name, None))
        for part, (fused, shard_id) in parts.items():
            if name not in routes and part in name:
                target, shard = name.replace(part, fused), shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                param.data.copy_(tensor.to(param.dtype))
            else:
                loader(param, tensor, shard)
        except (ValueError, RuntimeError) as err:      # a shape or dtype that does not fit
            raise ValueError(f"{name}: {err}") from None
        loaded.add((target, shard))
    missing = sorted(ckpt for key, ckpt in _expected(model, params).items()
                     if key not in loaded)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint lacks weights for: {missing[:8]}{more}")
