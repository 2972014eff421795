"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM): assembly only.

The model runs one flat batch of tokens per step: input_ids and positions are
[T]; attention reads and writes the paged KV cache through the metadata.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from folio.config import ModelConfig
from folio.model.attention.backend import get_attention_backend
from folio.model.attention.metadata import AttentionMetadata
from folio.model.layers.activation import silu_and_mul
from folio.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from folio.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear, prepack)
from folio.model.layers.norm import RMSNorm
from folio.model.layers.rotary import RotaryEmbedding, apply_rotary
from folio.model.native.decoder import NativeDecoder


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, False, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.attn = get_attention_backend(device)(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata):
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                      # [T, (H + 2 Hkv) * D]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q and k sit side by side in the fused output: one rotation for both.
        qk = apply_rotary(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), *rope)
        q, k = qk.split([h, hkv], dim=1)
        v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
        out = self.attn.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(t, h * d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """(hidden, residual) in and out: the residual add joins the next norm."""
        x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, device)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.native_decoder: NativeDecoder | None = None    # set once the weights are packed

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions)           # gathered once per step, used by every layer
        if self.native_decoder is not None and self.native_decoder.usable(hidden, meta):
            # the same kernels as the modules below, in one call (bf16 CPU)
            hidden, residual = self.native_decoder(hidden, rope, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        return self.norm(hidden, residual)[0]


# checkpoint name part -> (our parameter name part, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str):
        super().__init__()
        self.config = cfg
        self.weight_dtype: Optional[str] = None    # set before load_weights: see FolioConfig
        self.model = LlamaModel(cfg, dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for part, (ours, shard_id) in _STACKED.items():
                if part in name:
                    target, shard = name.replace(part, ours), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor.to(param.dtype))
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")
        prepack(self, self.weight_dtype)
        self.model.native_decoder = NativeDecoder.build(list(self.model.layers))
