"""Paged attention in Triton ("TRITON"): the default on CUDA; on the CPU only
when asked for by name under triton's interpreter (`TRITON_INTERPRET=1`),
which is how the tests run its kernels (kernels/triton_attention.py).

The layout is the common one, so block copies, prefix sharing and the KV
sizing are the other backends'. The metadata of a step is one int64 buffer
built on the host and copied once (pinned and non-blocking on CUDA): slots,
block tables, the decodes' context lengths, the prompt chunks and their tiles
of BLOCK_M query tokens.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from folio.kernels import triton_elementwise
from folio.model.attention.backend import (AttentionBackend, StepDescription, padded_tables,
                                           to_device)
from folio.model.attention.metadata import AttentionMetadata

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether triton runs kernels on the CPU, in its interpreter. Triton reads
    TRITON_INTERPRET when a kernel is defined, so it must be set before
    kernels/triton_attention.py is imported (before the process starts, for a user)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class TritonMetadata(AttentionMetadata):
    max_decode_context: int = 0                  # longest context among the decodes
    prefill_block_tables: Optional[torch.Tensor] = None   # [P, max_blocks]
    prefill_starts: Optional[torch.Tensor] = None   # [P]: first row of chunk i in the batch
    prefill_lens: Optional[torch.Tensor] = None     # [P]: its tokens
    prefill_positions: Optional[torch.Tensor] = None   # [P]: tokens before it in the cache
    tile_seqs: Optional[torch.Tensor] = None        # [tiles]: the chunk of each tile
    tile_starts: Optional[torch.Tensor] = None      # [tiles]: its first token in the chunk
    num_tiles: int = 0


def split_plan(num_seqs: int, num_kv_heads: int, max_context: int, target_programs: int,
               min_split_tokens: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens per split) of a decode launch: enough programs for the
    device (num_seqs x KV heads x splits >= target), none shorter than
    `min_split_tokens`, every split a whole number of BLOCK_N key tiles."""
    want = _cdiv(target_programs, num_seqs * num_kv_heads)
    splits = max(1, min(want, _cdiv(max_context, min_split_tokens)))
    per = _cdiv(_cdiv(max_context, splits), block_n) * block_n
    return _cdiv(max_context, per), per


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON"
    supports_graphs = True
    supports_sliding_window = True
    reads_8bit_kv = ("int8", "fp8", "fp8_e5m2")
    requirement = (" (it needs triton, and CUDA, or on the CPU triton's interpreter: "
                   "TRITON_INTERPRET=1, slow, for tests)")
    block_m = 16              # query tokens per prefill program
    block_n = 32              # keys per inner step
    min_split_tokens = 256    # the fewest keys a decode split is given
    mixed_launch = True       # a step of decodes and chunks in one launch (False: two)
    target_programs: Optional[int] = None   # None: 2 per streaming multiprocessor (1 on CPU)

    @classmethod
    def supports(cls, device, dtype):
        if dtype not in _DTYPES or importlib.util.find_spec("triton") is None:
            return False
        kind = torch.device(device).type
        return kind == "cuda" or (kind == "cpu" and interpreting())

    @classmethod
    def selectable(cls, device, dtype):
        return torch.device(device).type == "cuda" and cls.supports(device, dtype)

    @classmethod
    def build_metadata(cls, step: StepDescription) -> TritonMetadata:
        d = step.num_decodes
        lens = np.asarray(step.query_lens, dtype=np.int64)
        starts = np.asarray(step.start_positions, dtype=np.int64)
        rows = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        tables = padded_tables(step)
        tiles = [(i, q0) for i, n in enumerate(lens[d:]) for q0 in range(0, int(n), cls.block_m)]
        tile_arr = np.asarray(tiles, dtype=np.int64).reshape(-1, 2)
        parts = [step.slot_mapping, tables.ravel(), (starts + lens)[:d], rows[d:], lens[d:],
                 starts[d:], tile_arr[:, 0], tile_arr[:, 1]]
        flat = to_device(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]),
                          step.device)
        views, at = [], 0
        for p in parts:
            views.append(flat[at:at + p.size])
            at += p.size
        slots, tab, ctx, q_starts, q_lens, positions, tile_seqs, tile_starts = views
        tab = tab.view(tables.shape)
        return TritonMetadata(
            slot_mapping=slots, num_decodes=d, decode_block_tables=tab[:d],
            decode_context_lens=ctx, max_decode_context=int((starts + lens)[:d].max(initial=0)),
            prefill_block_tables=tab[d:], prefill_starts=q_starts, prefill_lens=q_lens,
            prefill_positions=positions, tile_seqs=tile_seqs, tile_starts=tile_starts,
            num_tiles=len(tiles))

    @classmethod
    def graph_metadata(cls, slot_mapping, block_tables, context_lens, max_context):
        return TritonMetadata(slot_mapping=slot_mapping, num_decodes=slot_mapping.shape[0],
                              decode_block_tables=block_tables,
                              decode_context_lens=context_lens, max_decode_context=max_context)

    def _target(self, device: torch.device) -> int:
        if self.target_programs is not None:
            return self.target_programs
        if device.type == "cuda":
            return 2 * torch.cuda.get_device_properties(device).multi_processor_count
        return 1

    def fuses_rotary_store(self, qkv, kv_cache):
        # a float cache of the run's dtype (an 8-bit one's rows are quantized
        # by torch, and the interpreter's rounding to bf16 is not torch's)
        return (triton_elementwise.serves(qkv) and kv_cache.dtype == qkv.dtype
                and qkv.stride(1) == 1)

    def rotary_store(self, qkv, rope, kv_cache, meta: TritonMetadata):
        triton_elementwise.rotary_store(qkv, rope[0], rope[1], self.num_heads,
                                        self.num_kv_heads, self.head_dim, kv_cache[0],
                                        kv_cache[1], meta.slot_mapping)

    def forward(self, q, k, v, kv_cache, meta: TritonMetadata, out=None):
        """`out` [T, H, D] (rows contiguous), where given, takes the answer (a
        piecewise graph's persistent buffer); else a new tensor."""
        from folio.kernels import triton_attention as tk
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if k is not None:           # else rotary_store wrote them
            tk.store_kv(k, v, k_cache, v_cache, meta.slot_mapping,
                        (self.static_scale(0), self.static_scale(1)))
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        window = self.sliding_window or 0
        if d and meta.num_tiles and self.mixed_launch:
            # decodes beside prompt chunks: one launch, the decodes unsplit (the
            # chunks' tiles keep the device busy)
            tk.paged_mixed(q, k_cache, v_cache, out, d, meta.decode_block_tables,
                           meta.decode_context_lens, meta.prefill_block_tables,
                           meta.tile_seqs, meta.tile_starts, meta.prefill_starts,
                           meta.prefill_lens, meta.prefill_positions, self.scale,
                           self.block_m, self.block_n, dot_fp32=interpreting(), window=window)
            return out
        if d:
            # a windowed layer's decode reads at most `window` keys a sequence,
            # from the start of the tile of its first
            keys = meta.max_decode_context
            if window:
                keys = min(keys, window + self.block_n)
            splits, per = split_plan(d, self.num_kv_heads, keys, self._target(q.device),
                                     self.min_split_tokens, self.block_n)
            tk.paged_decode(q[:d], k_cache, v_cache, meta.decode_block_tables,
                            meta.decode_context_lens, self.scale, out[:d], splits, per,
                            self.block_n, window=window, dot_fp32=interpreting())
        if meta.num_tiles:
            tk.paged_prefill(q, k_cache, v_cache, out, meta.prefill_block_tables,
                             meta.tile_seqs, meta.tile_starts, meta.prefill_starts,
                             meta.prefill_lens, meta.prefill_positions, self.scale,
                             self.block_m, self.block_n, dot_fp32=interpreting(),
                             window=window)
        return out

