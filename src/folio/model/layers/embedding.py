"""Vocabulary-parallel embedding and LM head (whole vocabulary at world size 1)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.layers.linear import linear, pack_weight
from folio.model.layers.quantization.base import QuantizationConfig
from folio.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp_size()
        self.shard = -(-vocab_size // self.tp)              # rows per rank (last padded)
        self.start = tp_rank() * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start:self.start + self.shard]
        param.data[:rows.shape[0]].copy_(rows.to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0), self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered; shares the embedding
    when the model ties them."""

    packed = None

    tied = False

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None):
        super().__init__(vocab_size, hidden, dtype)
        # the head stays float (a quantized format packs the decoder's layers);
        # only the storage choice of the CPU kernels applies
        self.store = None if quant_config is None else quant_config.weight_dtype

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight, self.tied = embedding.weight, True

    def process_weights_after_loading(self) -> None:
        # A tied head's plain weight stays (the embedding reads it); an untied
        # one keeps only the packed copy, as the linear layers do.
        self.packed = pack_weight(self.weight, self.store)
        if self.packed is not None and not self.tied:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, vocab] in the weight dtype (the sampler casts to fp32
        where it needs to: greedy batches read bf16 directly); fp32 across
        tensor-parallel ranks, for the gather."""
        local = linear(hidden, self.weight, self.packed)
        if self.tp > 1:
            local = local.float()
        return all_gather_last_dim(local, self.tp)[..., :self.vocab_size]
