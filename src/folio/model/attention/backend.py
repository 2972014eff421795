"""The attention backend interface: what a backend owns and what it is given.

A backend class owns three things, so that a new one (Triton on CUDA, say) is
one new module plus one line in `selector.py`:
- its KV cache layout (`get_kv_cache_shape`), which the runner allocates;
- its metadata, built once per step from one common description of the step
  (`StepDescription`, made by the runner from the scheduled sequences);
- the attention itself (`forward`, on an instance made per layer).

Every backend so far shares one layout per layer, [2, num_blocks, block_size,
num_kv_heads, head_dim] (index 0 keys, 1 values), and writes the step's keys
and values at `slot_mapping` before attending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch

from folio.model.attention.metadata import AttentionMetadata


@dataclass
class StepDescription:
    """The step's sequences in batch order (decodes first, then prompt chunks):
    what every backend builds its metadata from."""

    query_lens: list[int]            # tokens of each sequence in this step
    start_positions: list[int]       # tokens of each already in the cache
    block_tables: list[np.ndarray]   # int64 block ids of each, covering start + query
    slot_mapping: np.ndarray         # [T] int64: the KV slot each token writes
    positions: np.ndarray            # [T] int64
    num_decodes: int                 # the first sequences, one token each
    device: torch.device

    @classmethod
    def of_spans(cls, spans: list[tuple[int, int, np.ndarray]], block_size: int,
                 device: torch.device) -> tuple["StepDescription", list[int]]:
        """The step of query spans (start position, tokens, int64 block table),
        one-token spans first; and each span's last row."""
        pos, slots, last_rows = [], [], []
        num_decodes = row = 0
        for start, n, table in spans:
            p = np.arange(start, start + n, dtype=np.int64)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            num_decodes += n == 1
            row += n
            last_rows.append(row - 1)
        step = cls(query_lens=[n for _, n, _ in spans],
                   start_positions=[start for start, _, _ in spans],
                   block_tables=[table for _, _, table in spans],
                   slot_mapping=np.concatenate(slots), positions=np.concatenate(pos),
                   num_decodes=num_decodes, device=device)
        return step, last_rows


class AttentionBackend:
    name: ClassVar[str] = ""
    # what the one-call native decoder needs from the attention of a layer:
    # "paged_cpu" (native/paged_attention.c on this layout); None: not there
    native_kind: ClassVar[Optional[str]] = None
    # said when it is named where it does not run: what it needs
    requirement: ClassVar[str] = ""
    # decode steps may be replayed from CUDA graphs: `graph_metadata` gives a
    # fixed plan on persistent buffers (worker/cuda_graphs.py)
    supports_graphs: ClassVar[bool] = False
    # whether it runs a sliding-window layer (keys in the last `sliding_window`
    # positions only); one that does not refuses such a layer when it is made
    supports_sliding_window: ClassVar[bool] = False
    # the 8-bit KV caches it reads (--kv-cache-dtype int8 | fp8: kv_quant.py)
    reads_8bit_kv: ClassVar[tuple[str, ...]] = ()

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None):
        if sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(f"attention backend {self.name} does not run sliding-window "
                             f"layers (window {sliding_window}); choose one that does "
                             "with --attention-backend")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # a query at position p sees the keys at positions p - window < k <= p
        # (transformers' sliding_window_overlay); None: every key up to p
        self.sliding_window = sliding_window
        # a checkpoint's static (k_scales, v_scales), fp32 [num_kv_heads] each
        # (a per-tensor scale repeated), which an fp8 cache takes (the
        # attention module sets them once loaded); None: each row's own
        self.kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def static_scale(self, which: int) -> Optional[torch.Tensor]:
        """The checkpoint's scales of keys (0) or values (1), if it gave them."""
        return None if self.kv_scales is None else self.kv_scales[which]

    @classmethod
    def supports(cls, device: str, dtype: torch.dtype) -> bool:
        """Whether this backend runs on `device` in `dtype`."""
        raise NotImplementedError

    @classmethod
    def selectable(cls, device: str, dtype: torch.dtype) -> bool:
        """Whether the default choice may take it (a backend may run somewhere
        only when named: Triton's CPU interpreter, for tests)."""
        return cls.supports(device, dtype)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] of one layer's cache (copy-on-write)."""
        kv_cache[:, dst] = kv_cache[:, src]

    @classmethod
    def build_metadata(cls, step: StepDescription) -> AttentionMetadata:
        raise NotImplementedError

    @classmethod
    def graph_metadata(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, max_context: int) -> AttentionMetadata:
        """A decode-only step on persistent buffers whose launches do not depend
        on the values in them (contexts up to `max_context`)."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the step's tokens -> [T, H, D]."""
        raise NotImplementedError


def staged(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` as a host tensor to copy from: pinned when the copy goes to CUDA, so
    that it runs without the host waiting for it."""
    t = torch.from_numpy(a)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` (non-blocking from pinned memory on CUDA)."""
    return staged(a, device).to(device, non_blocking=True)


def padded_tables(step: StepDescription) -> np.ndarray:
    """[num_seqs, max_blocks] int64, 0-padded."""
    tables = step.block_tables
    padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    return padded

