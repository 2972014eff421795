"""Mixture-of-experts config.json fields -> ModelConfig's (the loader reads it
through the registry's `config_fields`, with its own size checks).

Mixtral calls its expert count `num_local_experts` and its experts' size
`intermediate_size` (every layer is MoE, the top-k weights always
renormalized); Qwen3-MoE writes `num_experts` (transformers 5 may save it as
`num_local_experts` too), `moe_intermediate_size`, `norm_topk_prob`,
`decoder_sparse_step` and `mlp_only_layers` (dense layers of
`intermediate_size`). Defaults are transformers' config classes'.
"""

from __future__ import annotations

from typing import Any

from folio.model.loader import config_size


def _positive(cfg: dict[str, Any], keys: tuple[str, ...], source: str, default=None) -> int:
    """The first of `keys` the config gives, as the loader reads a size."""
    key = next((k for k in keys if cfg.get(k) is not None), keys[0])
    return config_size(cfg, key, source, default)


def _routing(cfg: dict[str, Any], experts: int, source: str) -> int:
    top_k = _positive(cfg, ("num_experts_per_tok",), source, 2)
    if top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok ({top_k}) exceeds the number of "
                         f"experts ({experts})")
    return top_k


def mixtral_fields(cfg: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    experts = _positive(cfg, ("num_local_experts",), source, 8)
    return dict(num_experts=experts, num_experts_per_tok=_routing(cfg, experts, source),
                moe_intermediate_size=_positive(cfg, ("intermediate_size",), source),
                norm_topk_prob=True)


def qwen3_moe_fields(cfg: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    experts = _positive(cfg, ("num_experts", "num_local_experts"), source, 128)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in dense):
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, "
                         f"got {dense!r}")
    return dict(num_experts=experts, num_experts_per_tok=_routing(cfg, experts, source),
                moe_intermediate_size=_positive(cfg, ("moe_intermediate_size",), source, 768),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=_positive(cfg, ("decoder_sparse_step",), source, 1),
                mlp_only_layers=tuple(dense))

