"""A GGUF's metadata, read: `field` (a key of the file's metadata, or an
error naming it), and the fields of the architectures whose GGUFs say more
than Llama's (Gemma 3's windows and rope bases, Phi-3's window, a mixture of
experts' counts), as llama.cpp reads them, onto the ModelConfig
gguf_loader.py builds from the common ones."""

from __future__ import annotations

import dataclasses
from typing import Any

from folio.config import ModelConfig


MISSING = object()     # field()'s default: the key must be there


def field(reader, key: str, default: Any = MISSING) -> Any:
    value = reader.fields.get(key, MISSING)
    if value is MISSING:
        if default is MISSING:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return value


def gemma3_fields(reader, config: ModelConfig) -> ModelConfig:
    """Gemma 3's fields as llama.cpp reads them: local layers by
    attention.sliding_window_pattern (a bool a layer, or every n-th layer
    global; absent: 6), their rope base rope.freq_base_swa (absent: 10000),
    queries scaled by 1/sqrt(head_dim) but for the 27B (62 layers: 1/sqrt(hidden
    / heads)), GeGLU with tanh GELU."""
    def meta(key: str, default: Any = None) -> Any:
        return field(reader, f"gemma3.{key}", default)
    layers = config.num_hidden_layers
    window = int(meta("attention.sliding_window", 0) or 0)
    pattern = meta("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"sliding_window_pattern names {len(pattern)} layers of {layers}")
        local = [bool(p) for p in pattern]
    else:                           # 0: every layer local, as llama.cpp sets it
        n = int(pattern)
        local = [n == 0 or i % n < n - 1 for i in range(layers)]
    types = tuple("sliding_attention" if window and is_local else "full_attention"
                  for is_local in local)
    softcap = meta("final_logit_softcapping")
    scalar = config.hidden_size // config.num_attention_heads if layers == 62 \
        else config.head_dim
    return dataclasses.replace(
        config, layer_types=types, sliding_window=window or None,
        rope_local_theta=float(meta("rope.freq_base_swa", 10000.0)),
        rope_theta=float(meta("rope.freq_base", 1_000_000.0)),
        query_pre_attn_scalar=float(scalar), hidden_act="gelu_pytorch_tanh",
        final_logit_softcapping=None if softcap is None else float(softcap))


def phi3_fields(reader, config: ModelConfig) -> ModelConfig:
    """Phi-3's sliding window (0: none, as Phi-4's files say) on every layer,
    as its HF folder's; longrope's factor tensors are refused earlier (they
    have no HF name)."""
    window = int(field(reader, "phi3.attention.sliding_window", 0) or 0)
    if not window:
        return config
    return dataclasses.replace(config, sliding_window=window,
                               layer_types=("sliding_attention",) * config.num_hidden_layers)


def expert_fields(reader, config: ModelConfig, arch: str, experts: int) -> ModelConfig:
    """A mixture of experts' fields: Mixtral's GGUFs say "llama" with an expert
    count. llama.cpp renormalizes the top-k weights of both (norm_topk_prob); a
    layer without a router (ffn_gate_inp) is dense. Experts of a packable type
    stay in their codes as the linear layers' do (FusedMoE's GGUF tensors);
    others are dequantized at load."""
    name = "MixtralForCausalLM" if arch == "llama" else config.architecture
    if name not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        raise ValueError(f"GGUF architecture {arch!r} with {experts} experts is not supported")
    names = {t.name for t in reader.tensors}
    dense = tuple(i for i in range(config.num_hidden_layers)
                  if f"blk.{i}.ffn_gate_inp.weight" not in names)
    if name == "MixtralForCausalLM" and dense:
        raise ValueError(f"layers {list(dense)} have no router (ffn_gate_inp)")
    top_k = int(field(reader, f"{arch}.expert_used_count"))
    if not 0 < top_k <= experts:
        raise ValueError(f"expert_used_count {top_k} is not within 1..{experts}")
    size = int(field(reader, f"{arch}.expert_feed_forward_length", config.intermediate_size))
    return dataclasses.replace(config, architecture=name, num_experts=experts,
                               num_experts_per_tok=top_k, moe_intermediate_size=size,
                               norm_topk_prob=True, mlp_only_layers=dense)
