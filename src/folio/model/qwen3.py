"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head of q and of
k before the rotation (`q_norm`, `k_norm`, one weight of head_dim shared by
the heads), no q/k/v bias, and a head_dim of its own (config.json's, not
hidden / heads). The CPU's one-call native decoder runs the norms too
(native.head_rmsnorm_, the kernel the bf16 modules call).
"""

from __future__ import annotations

import torch

from folio.config import ModelConfig
from folio.kernels import native
from folio.model.layers.norm import RMSNorm
from folio.model.layers.rotary import apply_rotary
from folio.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend, quant=None,
                 prefix: str = ""):
        super().__init__(cfg, dtype, backend, quant, prefix)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def project(self, rope, hidden, kv_cache, meta):
        """Llama's, with each head of q and k normed before the rotation."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                      # [T, (H + 2 Hkv) * D]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
        if native.fuses(qkv):       # bf16 on the CPU: in place, as the one-call decoder does
            native.head_rmsnorm_(q, self.q_norm.weight, self.q_norm.eps)
            native.head_rmsnorm_(k, self.k_norm.weight, self.k_norm.eps)
            qk = qkv[:, :(h + hkv) * d].view(t, h + hkv, d)
        else:
            qk = torch.cat((self.q_norm.norm(q), self.k_norm.norm(k)), dim=1)
        qk = apply_rotary(qk, *rope)
        q, k = qk.split([h, hkv], dim=1)
        return q, k, qkv[:, (h + hkv) * d:].view(t, hkv, d)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
