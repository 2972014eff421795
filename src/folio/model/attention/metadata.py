"""Attention metadata: built once per step by the runner, passed to every layer.

The step's flat batch is ordered decodes first, then prefills:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      d: one query token per sequence
              decodes     prefill 0    prefill 1    p: a prompt chunk of one sequence

`slot_mapping[t]` is the physical KV slot token t writes to:
block_table[pos // block_size] * block_size + pos % block_size.

Two views of the same step: per kind (decode tables and lengths, prefill
spans) for the torch paths, and per token (`block_tables` with a row per
sequence, `token_rows`, `context_lens`) for the native kernel, which serves
every token of the step in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    token_start: int            # first row of this chunk in the flat batch
    num_tokens: int             # rows in the chunk
    start_pos: int              # tokens of the sequence already in the cache
    block_table: torch.Tensor   # [num_blocks_of_seq] int64, covers start_pos + num_tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [T] int64
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks] int64, 0-padded
    decode_context_lens: torch.Tensor | None = None   # [num_decodes] int64, incl. the new token
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_tables: torch.Tensor | None = None   # [num_seqs, max_blocks] int64, 0-padded
    token_rows: torch.Tensor | None = None     # [T] int64: each token's row of block_tables
    context_lens: torch.Tensor | None = None   # [T] int64: keys each token sees (position + 1)
