"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM): assembly only.

The model runs one flat batch of tokens per step: input_ids and positions are
[T]; attention reads and writes the paged KV cache through the metadata.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.parallel_state import tp_rank, tp_size
from folio.model.attention.backend import AttentionBackend
from folio.model.attention.metadata import AttentionMetadata
from folio.model.attention.selector import get_attention_backend
from folio.model.layers.activation import silu_and_mul
from folio.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from folio.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear, process_weights_after_loading)
from folio.model.layers.norm import RMSNorm
from folio.model.pipeline import StagePlan
from folio.model.layers.quantization.base import QuantizationConfig
from folio.model.layers.rotary import RotaryEmbedding, apply_rotary
from folio.model.native_decoder import NativeDecoder
from folio.model.shape import ModelShape
from folio.model.weight_loading import load_model_weights

Quant = Optional[QuantizationConfig]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend: type[AttentionBackend],
                 quant: Quant = None, prefix: str = ""):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, dtype,
                                          quant, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, False, dtype,
                                        quant, f"{prefix}.o_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        # a layer with a window (Mistral's, where sliding_window is shorter than
        # the positions run) attends to its last sliding_window keys only
        layer = int(prefix.split(".")[2]) if prefix.startswith("model.layers.") else 0
        window = cfg.window_of(layer) if cfg.layer_types else None
        self.attn = (backend(self.num_heads, self.num_kv_heads, d, d ** -0.5) if window is None
                     else backend(self.num_heads, self.num_kv_heads, d, d ** -0.5,
                                  sliding_window=window))
        if quant is not None and quant.kv_cache_scales:    # the checkpoint's, for fp8
            # per tensor: one; per head: this rank's KV heads' (as qkv_proj splits them)
            per_head = quant.kv_cache_scales == "attn_head"
            shape = (self.num_kv_heads, 1, 1) if per_head else (1,)
            for name in ("k_scale", "v_scale"):
                param = nn.Parameter(torch.ones(shape), requires_grad=False)
                param.weight_loader = self._load_kv_scale
                setattr(self, name, param)

    def _load_kv_scale(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        """A k_scale / v_scale: per tensor, or this rank's block of the
        checkpoint's per-head scales [num_kv_heads, 1, 1]."""
        if param.shape[0] > 1 or loaded.dim() == 3:
            heads = self.num_kv_heads
            replicas = self.qkv_proj.kv_replicas
            total = heads * tp_size() // replicas
            if tuple(loaded.shape) != (total, 1, 1):
                raise ValueError(f"a per-head KV cache scale of shape {tuple(loaded.shape)}, "
                                 f"expected ({total}, 1, 1)")
            start = (tp_rank() // replicas) * heads
            loaded = loaded[start:start + heads]
        elif loaded.numel() != 1:
            raise ValueError(f"a per-tensor KV cache scale of shape {tuple(loaded.shape)}")
        if not bool((loaded.float() > 0).all()):
            raise ValueError(f"a KV cache scale that is not positive: {loaded.flatten().tolist()}")
        param.data.copy_(loaded.reshape(param.shape).float())

    def process_weights_after_loading(self) -> None:
        """The checkpoint's static KV cache scales, to the backend, one per KV
        head (an fp8 cache takes them; others ignore them)."""
        if hasattr(self, "k_scale"):
            self.attn.kv_scales = tuple(
                p.detach().float().reshape(-1).expand(self.num_kv_heads).contiguous()
                for p in (self.k_scale, self.v_scale))

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata):
        q, k, v = self.project(rope, hidden, kv_cache, meta)
        out = self.attn.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(hidden.shape[0], -1))

    def project(self, rope, hidden, kv_cache, meta: AttentionMetadata):
        """q [T, H, D], k and v [T, Hkv, D] of the step's tokens, rotated; k and
        v None where the backend's fused kernel wrote them into the cache (a
        family with its own q/k treatment overrides this)."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                      # [T, (H + 2 Hkv) * D]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.attn.fuses_rotary_store(qkv, kv_cache):
            # one launch rotates q in place and writes the rotated keys and the
            # values into the cache; the attention then reads them there
            self.attn.rotary_store(qkv, rope, kv_cache, meta)
            return qkv[:, :h * d].view(t, h, d), None, None
        # q and k sit side by side in the fused output: one rotation for both.
        qk = apply_rotary(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), *rope)
        q, k = qk.split([h, hkv], dim=1)
        return q, k, qkv[:, (h + hkv) * d:].view(t, hkv, d)


class LlamaMLP(nn.Module):
    activations: tuple[str, ...] = ("silu",)      # the hidden_act values forward() computes

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: Quant = None,
                 prefix: str = ""):
        super().__init__()
        if cfg.hidden_act not in self.activations:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported "
                             f"({', '.join(self.activations)})")
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype, quant,
            f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype,
                                           quant, f"{prefix}.down_proj")

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention      # a family with its own attention names it here

    def __init__(self, cfg: ModelConfig, dtype, backend, quant: Quant = None, prefix: str = ""):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, dtype, backend, quant, f"{prefix}.self_attn")
        self.mlp = self.build_mlp(cfg, dtype, quant, prefix)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def build_mlp(self, cfg: ModelConfig, dtype, quant: Quant, prefix: str) -> nn.Module:
        """The layer's MLP (a MoE family's layers build a MoE block here)."""
        return LlamaMLP(cfg, dtype, quant, f"{prefix}.mlp")

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """(hidden, residual) in and out: the residual add joins the next norm."""
        q, k, v, residual = self.before_attention(rope, hidden, residual, kv_cache, meta)
        out = self.self_attn.attn.forward(q, k, v, kv_cache, meta)
        return self.after_attention(out, residual)

    # The layer in two pieces around its attention, which piecewise CUDA
    # graphs capture apart (worker/cuda_graphs.py); forward is the two joined.
    def before_attention(self, rope, hidden, residual, kv_cache, meta):
        """(q, k, v, residual): the input norm and the attention's projection."""
        x, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project(rope, x, kv_cache, meta), residual)

    def after_attention(self, attn_out, residual):
        """(hidden, residual) from the attention's output [T, H, D]."""
        x = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    pp_tensors = 2          # (hidden, residual) go from one pipeline stage to the next
    def __init__(self, cfg: ModelConfig, dtype, backend, quant: Quant = None,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer):
        super().__init__()
        # a pipeline stage builds its own layers only (model/pipeline.py)
        self.stage = StagePlan.current(cfg.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, quant,
            "model.embed_tokens") if self.stage.is_first else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_table_positions, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.layers = self.stage.module_list(
            cfg.num_hidden_layers,
            lambda i: layer_cls(cfg, dtype, backend, quant, f"model.layers.{i}"))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) \
            if self.stage.is_last else None
        self.native_decoder: NativeDecoder | None = None    # see build_native_decoder

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        """The final hidden states; on a pipeline stage before the last, its
        (hidden, residual) for the next stage, which passes them as
        `intermediate` (and its input ids are not read)."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary(positions)           # gathered once per step, used by every layer
        if self.native_decoder is not None and \
                self.native_decoder.usable(hidden, meta, kv_caches):
            # the same kernels as the modules below, in one call (bf16 CPU)
            hidden, residual = self.native_decoder(hidden, rope, kv_caches, meta, residual)
        else:
            for layer, kv_cache in zip(self.stage.owned(self.layers), kv_caches):
                hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        if not self.stage.is_last:
            return hidden, residual
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    layer_cls = LlamaDecoderLayer
    # checkpoint names -> our fused parameters (with each shard's id)
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str,
                 quant_config: Quant = None,
                 attn_backend: Optional[type[AttentionBackend]] = None):
        super().__init__()
        self.config = cfg
        self.attn_backend = attn_backend or get_attention_backend(device, dtype)
        self.model = self.model_cls(cfg, dtype, self.attn_backend, quant_config, self.layer_cls)
        # the logits are stage 0's, beside the sampler's state (model/pipeline.py)
        # a checkpoint saved as its base model has no head: the embeddings stand in
        # for it (nothing is generated from such a model: input_processor refuses)
        tied = cfg.tie_word_embeddings or cfg.headless
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, quant_config,
                                      "lm_head", tied=tied) \
            if self.model.stage.is_first else None
        if tied and self.lm_head is not None:
            self.lm_head.tie(self.model.embed_tokens)

    @classmethod
    def shape(cls, cfg: ModelConfig) -> ModelShape:
        """The sizes of the model this class builds from cfg (model/shape.py)."""
        return ModelShape.of(cfg)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                intermediate=None):
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    @property
    def stage(self):
        """This rank's pipeline stage (model/pipeline.py): its layers, first, last."""
        return self.model.stage

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads this rank caches (what the KV cache is sized by)."""
        return self.model.layers[self.model.stage.layers[0]].self_attn.num_kv_heads

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        return ("lm_head.weight",) if self.config.tie_word_embeddings else ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load, then let every weight method prepare its tensors."""
        load_model_weights(self, weights)
        process_weights_after_loading(self)

    def build_native_decoder(self) -> None:
        """Run every decoder layer of a step in one native call where each
        layer's weight method and attention report what that call needs
        (native/decoder.py); otherwise the modules run."""
        stage = self.model.stage        # a pipeline stage's own layers
        self.model.native_decoder = NativeDecoder.build(stage.owned(self.model.layers))
