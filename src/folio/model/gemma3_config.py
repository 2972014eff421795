"""Gemma 3's config.json fields -> ModelConfig's (no torch: the loader reads it).

Two dialects reach the same fields. transformers 5 writes `layer_types` and
`rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}`;
earlier versions write `sliding_window_pattern` (every n-th layer global),
`rope_theta` (global), `rope_local_base_freq` (local) and `rope_scaling`
(global layers only). Defaults are Gemma3TextConfig's.
"""

from __future__ import annotations

from typing import Any, Optional

SLIDING, FULL = "sliding_attention", "full_attention"
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


def _layer_types(cfg: dict[str, Any], layers: int, source: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    types = tuple(types)
    if len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"{source}: layer_types must name {layers} layers, each "
                         f"{SLIDING!r} or {FULL!r}; got {list(types)}")
    return types


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, Optional[dict], float]:
    """(global theta, global scaling normalised with "rope_type" or None, local theta)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = dict(cfg.get("rope_scaling") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", _GLOBAL_THETA))
        local = {"rope_theta": cfg.get("rope_local_base_freq", _LOCAL_THETA)}
    local_type = local.get("rope_type") or local.get("type") or "default"
    if local_type != "default":
        raise ValueError(f"{source}: rope scaling of the sliding-window layers "
                         f"({local_type!r}) is not supported")
    theta = float(full.pop("rope_theta", None) or _GLOBAL_THETA)
    kind = full.pop("rope_type", None) or full.pop("type", None) or "default"
    full.pop("type", None)
    scaling = None if kind == "default" else {"rope_type": kind, **full}
    return theta, scaling, float(local.get("rope_theta") or _LOCAL_THETA)


def hf_fields(cfg: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """The ModelConfig fields that Gemma 3 spells its own way, or refuses."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{source}: attn_logit_softcapping="
                         f"{cfg['attn_logit_softcapping']} is not supported (Gemma 3 "
                         "checkpoints set it to null)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true is not supported "
                         "(a causal language model only)")
    types = _layer_types(cfg, layers, source)
    window = cfg.get("sliding_window")
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int)
                             or window < 1):
        raise ValueError(f"{source}: sliding_window must be a positive integer for "
                         f"sliding-window layers, got {window!r}")
    theta, scaling, local_theta = _rope(cfg, source)
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        layer_types=types, sliding_window=window if SLIDING in types else None,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=None if softcap is None else float(softcap),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
