"""Vocabulary-parallel embedding and LM head (whole vocabulary at world size 1).

A format may keep the table in its codes (a GGUF's Q8_0 `token_embd`:
`QuantizationConfig.get_embedding_method`): the embedding then looks up
rows of the packed form and dequantizes them, and a tied LM head multiplies
by that same packed form with the quantized kernel, one copy for both.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.kernels import native
from folio.model.layers.linear import linear, pack_weight
from folio.model.layers.quantization.base import QuantizationConfig
from folio.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size


def vocab_shard(vocab_size: int, tp: int) -> int:
    """Rows of the vocabulary one rank holds (the last rank's padded)."""
    return -(-vocab_size // tp)


class VocabParallelEmbedding(nn.Module):
    quant_method = None         # a packed table's method (IntGroupsLinear once loaded)

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        super().__init__()
        self.vocab_size, self.dtype = vocab_size, dtype
        self.tp = tp_size()
        self.shard = vocab_shard(vocab_size, self.tp)
        self.start = tp_rank() * self.shard
        method = None if quant_config is None else quant_config.get_embedding_method(self, prefix)
        if method is not None:
            self.quant_method = method
            method.create_weights(self, hidden, self.shard, dtype)
            return
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start:self.start + self.shard]
        if rows.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint rows of shape {tuple(rows.shape[1:])} do not fit "
                             f"parameter rows of shape {tuple(param.shape[1:])}")
        param.data[:rows.shape[0]].copy_(rows.to(param.dtype))

    @property
    def packed_table(self):
        """The IntGroups of a table kept in its codes, once loaded (else None)."""
        method = self.quant_method
        return getattr(method, "weights", None)

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.packed_table
        if table is None:
            return F.embedding(ids, self.weight)
        if (table.codes.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                and native.load() is not None):     # the same rows, without a dozen torch ops
            return native.dequantize_rows(table, ids, self.dtype)
        return table.dequantize_rows(ids, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = self._lookup(local.masked_fill(outside, 0))
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0), self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered; shares the embedding
    when the model ties them."""

    packed = None

    tied = False

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "lm_head",
                 tied: bool = False):
        # a tied head has no table of its own (tie() gives it the embedding's)
        super().__init__(vocab_size, hidden, dtype, None if tied else quant_config, prefix)
        # a float head: only the storage choice of the CPU kernels applies
        self.store = None if quant_config is None else quant_config.weight_dtype

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.tied, self.embedding = True, embedding
        if embedding.quant_method is None:
            self.weight = embedding.weight
        else:
            del self.weight

    def process_weights_after_loading(self) -> None:
        if self.tied and self.embedding.quant_method is not None:
            return                      # the embedding's packed table serves both
        if self.quant_method is not None:
            super().process_weights_after_loading()
            return
        # A tied head's plain weight stays (the embedding reads it); an untied
        # one keeps only the packed copy, as the linear layers do.
        self.packed = pack_weight(self.weight, self.store)
        if self.packed is not None and not self.tied:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, vocab] in the weight dtype (the sampler casts to fp32
        where it needs to: greedy batches read bf16 directly); fp32 across
        tensor-parallel ranks, for the gather."""
        source = self.embedding if self.tied else self
        if source.quant_method is not None:
            local = source.quant_method.apply(source, hidden)
        else:
            local = linear(hidden, self.weight, self.packed)
        if self.tp > 1:
            local = local.float()
        return all_gather_last_dim(local, self.tp)[..., :self.vocab_size]
