"""A model's sizes, as it answers for them: `shape_of(cfg)` asks the
architecture's class (`Model.shape(cfg)`), so `folio plan`, the benchmarks'
FLOP counts and the weight report read the model's own linear layers,
experts and KV heads instead of re-deriving Llama's.

A decoder layer is its attention (q/k/v fused, o) and either a dense MLP
(gate/up fused, down) or a mixture of experts: a router and `experts` expert
MLPs of `expert_intermediate`, of which each token runs `experts_per_token`.
Tensor parallelism splits them as Folio's layers do (`linears(tp)`): heads
and KV heads by `heads_per_rank`, every MLP's and every expert's
intermediate features by the size; the router is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Linear:
    """`count` linear layers of [out, inp] in the whole model (one rank's part)."""
    out: int
    inp: int
    count: int
    kind: str = "dense"         # "dense" | "expert" (run by the tokens that pick it) |
                                # "router" (kept in the run dtype, never quantized)

    @property
    def parameters(self) -> int:
        return self.out * self.inp * self.count


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    intermediate: int               # a dense layer's MLP features
    moe_layers: int = 0             # layers whose MLP is a mixture of experts
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    window: Optional[int] = None    # the sliding window of `windowed_layers` of them
    windowed_layers: int = 0

    @classmethod
    def of(cls, cfg) -> "ModelShape":
        """A Llama-shaped ModelConfig's: every layer dense; the layers its
        layer_types say (Gemma 3's local ones, every layer of a Mistral with a
        sliding_window) attend to their window only."""
        windowed = (sum(t == "sliding_attention" for t in cfg.layer_types)
                    if cfg.sliding_window else 0)
        return cls(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size,
                   cfg.tie_word_embeddings, cfg.intermediate_size,
                   window=cfg.sliding_window if windowed else None, windowed_layers=windowed)

    def linears(self, tp: int = 1) -> list[Linear]:
        """One rank's linear layers at tensor-parallel size tp; a size that does
        not divide the heads or features is a ValueError, as the layers raise."""
        from folio.model.layers.linear import _divide, heads_per_rank
        heads, kv, _ = heads_per_rank(self.heads, self.kv_heads, tp)
        out = [Linear((heads + 2 * kv) * self.head_dim, self.hidden, self.layers),
               Linear(self.hidden, heads * self.head_dim, self.layers)]
        dense = self.layers - self.moe_layers
        if dense:
            inter = _divide(self.intermediate, tp, "intermediate size")
            out += [Linear(2 * inter, self.hidden, dense), Linear(self.hidden, inter, dense)]
        if self.moe_layers:
            inter = _divide(self.expert_intermediate, tp, "experts' intermediate size")
            n = self.moe_layers * self.experts
            out += [Linear(self.experts, self.hidden, self.moe_layers, "router"),
                    Linear(2 * inter, self.hidden, n, "expert"),
                    Linear(self.hidden, inter, n, "expert")]
        return out

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def parameters(self) -> int:
        """Every weight: the linear layers, embedding and LM head (norms left out)."""
        return sum(lin.parameters for lin in self.linears()) + self.embedding_parameters()

    def expert_share(self, tokens: int = 1) -> float:
        """The share of the experts a step of `tokens` tokens reads: the expected
        share that some token picks, routing taken as uniform (k/E for one)."""
        if not self.experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens

    def active_linear_parameters(self, tp: int = 1) -> int:
        """The linear parameters one token runs through (one rank's share): its
        experts only, not all of them."""
        return sum(round(lin.parameters * (self.expert_share() if lin.kind == "expert" else 1))
                   for lin in self.linears(tp))

    def mlp_width(self, tp: int = 1) -> int:
        """The widest MLP activation one token makes on a rank (its experts' together)."""
        dense = self.intermediate // tp if self.layers > self.moe_layers else 0
        return max(dense, self.experts_per_token * self.expert_intermediate // tp)

    def active_parameters(self) -> int:
        return self.active_linear_parameters() + self.embedding_parameters()

    def kv_bytes_per_token(self, kv_heads: Optional[int] = None, dtype_bytes: int = 2,
                           kv_dtype: Optional[str] = None) -> int:
        """Keys and values of one token over all layers (`kv_heads`: one rank's);
        `kv_dtype` (a --kv-cache-dtype: bfloat16, float32, int8, whose rows
        carry their 4-byte scales) instead of `dtype_bytes`."""
        row = self.head_dim * dtype_bytes
        if kv_dtype is not None:
            from folio.model.attention import kv_quant
            row = kv_quant.row_width(self.head_dim, kv_dtype) * \
                kv_quant.storage_dtype(kv_dtype).itemsize
        return self.layers * 2 * (kv_heads or self.kv_heads) * row

    def attended(self, tokens: int) -> int:
        """Keys the first `tokens` positions of a sequence attend to, summed over
        the positions and the layers (a windowed layer's at most its window)."""
        full = tokens * (tokens + 1) // 2
        w = self.window
        windowed = full if not w or tokens <= w else w * (w + 1) // 2 + (tokens - w) * w
        return (self.layers - self.windowed_layers) * full + self.windowed_layers * windowed

    def sequence_flops(self, processed: int, sampled: int) -> float:
        """FLOPs of running `processed` positions of one sequence and sampling
        `sampled` of them: 2 x the linear parameters each runs, 4 x the query
        width per key attended, 2 x the LM head per sampled position."""
        return (2 * self.active_linear_parameters() * processed
                + 4 * self.heads * self.head_dim * self.attended(processed)
                + 2 * self.vocab * self.hidden * sampled)

    def flops_per_token(self, position: int) -> float:
        """One decoded token's FLOPs at `position` (LM head included)."""
        return self.sequence_flops(position + 1, 1) - self.sequence_flops(position, 0)


def shape_of(cfg) -> ModelShape:
    """The model's shape, as the class that builds it states it."""
    from folio.model.registry import model_class
    return model_class(cfg.architecture).shape(cfg)
