"""Gemma 3, text only (`Gemma3ForCausalLM`): Llama's projections with Gemma's
own layer around them.

- embeddings scaled by sqrt(hidden_size), the factor rounded to the model
  dtype first (as transformers does);
- RMSNorm that scales by (1 + w) in fp32 before the cast back (the weight is
  stored as an offset from one), four a layer: before and after attention,
  before and after the MLP, the residual added after each post-norm;
- the same (1 + w) RMSNorm over each head of q and of k before the rotation;
- GeGLU: gelu (tanh approximation) of gate times up;
- attention scaled by query_pre_attn_scalar ** -0.5;
- local layers (config `layer_types`: "sliding_attention") attend to the last
  `sliding_window` positions with their own rope base (rope_local_theta);
  global ones ("full_attention") to the whole context with rope_theta and its
  scaling. Each layer's attention backend knows its window.
- final_logit_softcapping, when set: logits = cap * tanh(logits / cap).

The one-call native decoder does not run these layers (it knows Llama's
shape): the modules run, on the CPU's native attention kernel or torch's.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from folio.config import ModelConfig
from folio.kernels import triton_elementwise
from folio.model.attention.selector import get_attention_backend, windowed_backends
from folio.model.gemma3_config import SLIDING
from folio.model.layers.embedding import VocabParallelEmbedding
from folio.model.layers.rotary import RotaryEmbedding, apply_rotary
from folio.model.pipeline import StagePlan
from folio.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32, then cast back."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, dtype, backend, quant=None, prefix: str = "",
                 sliding: bool = False):
        super().__init__(cfg, dtype, backend, quant, prefix)
        self.attn = backend(self.num_heads, self.num_kv_heads, cfg.head_dim,
                            cfg.query_pre_attn_scalar ** -0.5,
                            sliding_window=cfg.sliding_window if sliding else None)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, rope, hidden, kv_cache, meta):
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                      # [T, (H + 2 Hkv) * D]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
        qk = apply_rotary(torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), *rope)
        q, k = qk.split([h, hkv], dim=1)
        v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
        out = self.attn.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(t, h * d))


class GemmaMLP(LlamaMLP):
    """Llama's gate/up and down projections with GeGLU between them."""
    activations = tuple(_GELU)

    def __init__(self, cfg: ModelConfig, dtype, quant=None, prefix: str = ""):
        super().__init__(cfg, dtype, quant, prefix)
        self.approximate = _GELU[cfg.hidden_act]

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.approximate == "tanh" and triton_elementwise.serves(gate_up) \
                and gate_up.dim() == 2:
            return self.down_proj(triton_elementwise.gated_act(gate_up, gelu=True))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(nn.Module):
    native_decoder_shape = False        # not Llama's: the one-call decoder declines it

    def __init__(self, cfg: ModelConfig, dtype, backend, quant=None, prefix: str = "",
                 sliding: bool = False):
        super().__init__()
        self.sliding = sliding
        self.self_attn = Gemma3Attention(cfg, dtype, backend, quant, f"{prefix}.self_attn",
                                         sliding)
        self.mlp = GemmaMLP(cfg, dtype, quant, f"{prefix}.mlp")
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, rope, hidden, kv_cache, meta):
        x = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(x)
        x = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(x)


class Gemma3Model(nn.Module):
    pp_tensors = 1          # its layers add their own residual: hidden alone goes on
    def __init__(self, cfg: ModelConfig, dtype, backend, quant=None,
                 layer_cls: type[Gemma3DecoderLayer] = Gemma3DecoderLayer):
        super().__init__()
        self.stage = StagePlan.current(cfg.num_hidden_layers)     # model/pipeline.py
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, quant,
            "model.embed_tokens") if self.stage.is_first else None
        # transformers multiplies by the factor cast to the weights' dtype
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5).to(dtype),
                             persistent=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_table_positions, cfg.rope_theta,
                                      cfg.rope_scaling)
        types = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
        self.rotary_local = (RotaryEmbedding(cfg.head_dim, cfg.rope_table_positions,
                                             cfg.rope_local_theta or 10000.0)
                             if SLIDING in types else None)
        self.layers = self.stage.module_list(cfg.num_hidden_layers, lambda i: layer_cls(
            cfg, dtype, backend, quant, f"model.layers.{i}", sliding=types[i] == SLIDING))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) \
            if self.stage.is_last else None
        self.native_decoder = None      # the one-call decoder does not run Gemma's layers

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        """As LlamaModel's; a stage before the last passes on (hidden,)."""
        if intermediate is None:
            hidden = self.embed_tokens(input_ids) * self.normalizer
        else:
            hidden, = intermediate
        rope = self.rotary(positions)           # gathered once per step for each kind
        local = self.rotary_local(positions) if self.rotary_local is not None else None
        for layer, kv_cache in zip(self.stage.owned(self.layers), kv_caches):
            hidden = layer(local if layer.sliding else rope, hidden, kv_cache, meta)
        if not self.stage.is_last:
            return (hidden,)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model
    layer_cls = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str, quant_config=None,
                 attn_backend=None):
        if cfg.query_pre_attn_scalar is None:
            raise ValueError("Gemma 3 needs query_pre_attn_scalar (read from config.json)")
        attn_backend = attn_backend or get_attention_backend(device, dtype)
        if cfg.sliding_window is not None and not attn_backend.supports_sliding_window:
            raise ValueError(f"attention backend {attn_backend.name} does not run "
                             f"sliding-window layers (Gemma 3's local layers, window "
                             f"{cfg.sliding_window}); choose one that does with "
                             f"--attention-backend: {', '.join(windowed_backends())}")
        super().__init__(cfg, dtype, device, quant_config, attn_backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
