"""Phi-3 (`Phi3ForCausalLM`): Llama's graph, with the checkpoint's q/k/v fused
in one `qkv_proj` (rows q, then k, then v) and gate/up in one `gate_up_proj`
(gate rows first). The loader splits both back into the projections Llama's
layers load (so tensor parallelism shards them as it shards Llama's). Its
`sliding_window` is every layer's, as Mistral's (llama.py); a partial rotary
(`partial_rotary_factor` < 1, Phi-4-mini) and longrope scaling (the 128k
models) are refused by name (phi3_fields, the rotary's scaling check).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from folio.model.llama import LlamaForCausalLM


def phi3_fields(cfg: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    """config.json fields Phi-3 spells its own way: none it runs; what it
    cannot run is refused here, before anything loads."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={factor} (a partial rotary) is "
                         "not supported")
    return {}


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, tensor in weights:
            if name.endswith(".self_attn.qkv_proj.weight"):
                base = name[:-len("qkv_proj.weight")]
                if tensor.shape[0] != q + 2 * kv:
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, expected q + k + v = "
                                     f"{q + 2 * kv}")
                yield base + "q_proj.weight", tensor[:q]
                yield base + "k_proj.weight", tensor[q:q + kv]
                yield base + "v_proj.weight", tensor[q + kv:]
            elif name.endswith(".mlp.gate_up_proj.weight"):
                base = name[:-len("gate_up_proj.weight")]
                gate, up = tensor.chunk(2)
                yield base + "gate_proj.weight", gate
                yield base + "up_proj.weight", up
            else:
                yield name, tensor
