"""The native CPU kernel ("CPU_NATIVE"): every token of the step, decodes and
prompt chunks, in one call (native/paged_attention.c), fp32 or bf16, over an
fp32, bf16 or 8-bit cache.

Its metadata is per token (a block-table row per sequence, each token's row
and context length); it also carries the torch backend's per-kind view, which
a step takes when the kernel is switched off at run time (tests do).
"""

from __future__ import annotations

import numpy as np
import torch

from folio.kernels import native
from folio.model.attention.backend import StepDescription, padded_tables
from folio.model.attention.metadata import AttentionMetadata
from folio.model.attention.torch_backend import TorchAttentionBackend


class CPUNativeAttentionBackend(TorchAttentionBackend):
    name = "CPU_NATIVE"
    native_kind = "paged_cpu"
    supports_sliding_window = True
    # paged_attention.c widens the rows in registers
    reads_8bit_kv = ("int8", "fp8", "fp8_e5m2")

    @classmethod
    def supports(cls, device, dtype):
        return (torch.device(device).type == "cpu"
                and native.supports(torch.empty(0, dtype=dtype)))

    @classmethod
    def build_metadata(cls, step: StepDescription) -> AttentionMetadata:
        meta = cls._per_kind(step)
        tables = torch.from_numpy(padded_tables(step)).to(step.device)
        rows = np.repeat(np.arange(len(step.query_lens), dtype=np.int64), step.query_lens)
        meta.block_tables = tables
        meta.token_rows = torch.from_numpy(rows).to(step.device)
        meta.context_lens = torch.from_numpy(step.positions + 1).to(step.device)
        if meta.num_decodes:      # the same rows, shared with the per-kind view
            meta.decode_block_tables = tables[:meta.num_decodes]
            meta.decode_context_lens = meta.context_lens[:meta.num_decodes]
        return meta

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        if native.supports(q):
            return native.paged_attention(q, kv_cache, meta.block_tables, meta.token_rows,
                                          meta.context_lens, self.scale,
                                          sliding_window=self.sliding_window)
        return self.attend(q, k, v, kv_cache, meta)
