"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE, Llama's assembly with a
fused MoE block (layers/moe.py) in place of the MLP where the config says.

Mixtral: Llama's attention, every layer MoE (checkpoint names
`block_sparse_moe.experts.E.w1/w3/w2` and `block_sparse_moe.gate`), the top-k
weights renormalized and applied in fp32. Qwen3-MoE: Qwen3's attention (per-head
q/k norms), layer i MoE where (i + 1) % decoder_sparse_step == 0 and i is not
in mlp_only_layers, else a dense MLP of intermediate_size (names
`mlp.experts.E.gate_proj/up_proj/down_proj` and `mlp.gate`), renormalized
only with norm_topk_prob. Neither has shared experts. transformers' fused
form of the experts (3-D tensors) loads too.

Experts stored quantized (GPTQ, AWQ, compressed-tensors checkpoints) load
through their format's linear method, one layer per expert matrix, and are
kept in IntGroups' codes; a GGUF's packable experts likewise;
`--quantization int8|int4` quantizes the float experts at load (layers/moe.py).
The CPU's one-call native decoder runs MoE layers where their experts are
packed for a native kernel or held as IntGroups (native/decoder.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn

from folio.config import ModelConfig
from folio.kernels import native
from folio.model.layers.linear import process_weights_after_loading
from folio.model.layers.moe import FusedMoE
from folio.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from folio.model.qwen3 import Qwen3Attention
from folio.model.weight_loading import load_model_weights


@dataclasses.dataclass(frozen=True)
class _MoEStyle:
    """How a family names and weighs its experts."""
    checkpoint_block: str                   # the MoE block's name under model.layers.N
    names: tuple[str, str, str]             # the experts' (gate, up, down) tensor names
    weights_in_float: bool                  # top-k weights applied in fp32 (else the dtype)
    # another spelling of the block and its experts that checkpoints use,
    # read as this one (gptqmodel saves Mixtral's experts as transformers 5
    # holds them: mlp.experts.E.gate_proj/up_proj/down_proj, router mlp.gate)
    alias: Optional[tuple[str, tuple[str, str, str]]] = None


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's layer whose `mlp` is a FusedMoE on the layers `is_moe` picks."""
    style: _MoEStyle

    def build_mlp(self, cfg: ModelConfig, dtype, quant, prefix: str) -> nn.Module:
        if not self.is_moe(cfg, int(prefix.rsplit(".", 1)[1])):     # model.layers.{i}
            return super().build_mlp(cfg, dtype, quant, prefix)
        s = self.style
        return FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                        cfg.num_experts_per_tok, cfg.norm_topk_prob, dtype,
                        f"{prefix}.{s.checkpoint_block}", s.names, s.weights_in_float,
                        quant_config=quant)

    @staticmethod
    def is_moe(cfg: ModelConfig, index: int) -> bool:
        return cfg.num_experts > 0


class MoEForCausalLM(LlamaForCausalLM):
    layer_cls: type[MoEDecoderLayer]

    @classmethod
    def shape(cls, cfg: ModelConfig):
        """Its MoE layers (those `is_moe` picks) hold experts instead of a dense MLP."""
        moe = sum(cls.layer_cls.is_moe(cfg, i) for i in range(cfg.num_hidden_layers))
        return dataclasses.replace(super().shape(cfg), moe_layers=moe,
                                   experts=cfg.num_experts,
                                   experts_per_token=cfg.num_experts_per_tok,
                                   expert_intermediate=cfg.moe_intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The per-expert tensors transformers writes by default, or its fused form
        (save_pretrained(save_original_format=False)): `mlp.experts.gate_up_proj`
        [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], split here into the
        per-expert names the layers declare (the router is `mlp.gate.weight`
        there, which is its parameter's own name). The decoder layers' bf16
        weights are packed for the native kernel even on an AMX CPU
        (native_bf16_over_amx: each expert sees a few rows a step, and the
        one-call decoder runs them); the LM head keeps oneDNN there."""
        load_model_weights(self, self._per_expert(weights))
        with native.native_bf16_over_amx():
            process_weights_after_loading(self.model.layers)
        process_weights_after_loading(self, exclude=self.model.layers)

    def _per_expert(self, weights):
        style = self.layer_cls.style
        gate, up, down = style.names
        for name, tensor in self._unaliased(weights):
            base, _, kind = name.rpartition(".experts.")
            if not base or kind not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
                yield name, tensor
                continue
            experts = f"{base.rsplit('.', 1)[0]}.{style.checkpoint_block}.experts"
            for e, t in enumerate(tensor):
                if kind == "down_proj":
                    yield f"{experts}.{e}.{down}.weight", t
                else:
                    g, u = t.chunk(2)
                    yield f"{experts}.{e}.{gate}.weight", g
                    yield f"{experts}.{e}.{up}.weight", u


    def _unaliased(self, weights):
        """The style's alias spelling of a MoE block's tensors, renamed to its own."""
        style = self.layer_cls.style
        if style.alias is None:
            yield from weights
            return
        block, names = style.alias
        renames = dict(zip(names, style.names))
        ours, theirs = f".{style.checkpoint_block}.", f".{block}."
        for name, tensor in weights:
            if f"{theirs}gate." in name:
                name = name.replace(f"{theirs}gate.", f"{ours}gate.")
            elif f"{theirs}experts." in name:
                head, _, rest = name.partition(f"{theirs}experts.")
                e, leaf, tail = (rest.split(".", 2) + ["", ""])[:3]
                if leaf in renames:
                    name = f"{head}{ours}experts.{e}.{renames[leaf]}.{tail}"
            yield name, tensor


class MixtralDecoderLayer(MoEDecoderLayer):
    style = _MoEStyle("block_sparse_moe", ("w1", "w3", "w2"), weights_in_float=True,
                      alias=("mlp", ("gate_proj", "up_proj", "down_proj")))


class MixtralForCausalLM(MoEForCausalLM):
    layer_cls = MixtralDecoderLayer


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention
    style = _MoEStyle("mlp", ("gate_proj", "up_proj", "down_proj"), weights_in_float=False)

    @staticmethod
    def is_moe(cfg: ModelConfig, index: int) -> bool:
        return (cfg.num_experts > 0 and index not in cfg.mlp_only_layers
                and (index + 1) % cfg.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
