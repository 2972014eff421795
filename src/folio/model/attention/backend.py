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


class TableRows:
    """Each sequence's block table as a row of one 0-padded int64 array
    [S, W] and its length: reads as a list of int64 arrays (row i cut to
    its length), and hands the padded array to a backend as it is."""

    __slots__ = ("padded", "lens")

    def __init__(self, padded: np.ndarray, lens: np.ndarray):
        self.padded, self.lens = padded, lens

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.padded[i, :self.lens[i]]

    def __iter__(self):
        return (row[:n] for row, n in zip(self.padded, self.lens.tolist()))


@dataclass
class StepDescription:
    """The step's sequences in batch order (decodes first, then prompt chunks):
    what every backend builds its metadata from."""

    query_lens: list[int]            # tokens of each sequence in this step
    start_positions: list[int]       # tokens of each already in the cache
    # int64 block ids of each, covering start + query (a list of arrays, or
    # TableRows: the runner's persistent rows gathered)
    block_tables: "list[np.ndarray] | TableRows"
    slot_mapping: np.ndarray         # [T] int64: the KV slot each token writes
    positions: np.ndarray            # [T] int64
    num_decodes: int                 # the first sequences, one token each
    device: torch.device

    @classmethod
    def of_spans(cls, spans: list[tuple[int, int, np.ndarray]], block_size: int,
                 device: torch.device) -> tuple["StepDescription", list[int]]:
        """The step of query spans (start position, tokens, int64 block table),
        one-token spans first; and each span's last row."""
        lens = np.array([len(t) for _, _, t in spans], dtype=np.int64)
        padded = np.zeros((len(spans), int(lens.max(initial=1))), dtype=np.int64)
        for i, (_, _, table) in enumerate(spans):
            padded[i, :len(table)] = table
        return cls.of_rows([s for s, _, _ in spans], [n for _, n, _ in spans],
                           TableRows(padded, lens), block_size, device)

    @classmethod
    def of_rows(cls, starts: list[int], query_lens: list[int], tables: TableRows,
                block_size: int, device: torch.device) -> tuple["StepDescription", list[int]]:
        """The step of sequences starting at `starts` with `query_lens` tokens
        each, their block tables in `tables`: positions and slots computed for
        the whole batch at once (no per-sequence loop); and each one's last row."""
        q = np.asarray(query_lens, dtype=np.int64)
        ends = np.cumsum(q)
        seq_of = np.repeat(np.arange(len(q)), q)
        # each token's position: its row minus its span's first row, plus its start
        positions = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(
            np.asarray(starts, dtype=np.int64) - (ends - q), q)
        slots = (tables.padded[seq_of, positions // block_size] * block_size
                 + positions % block_size)
        step = cls(query_lens=list(query_lens), start_positions=list(starts),
                   block_tables=tables, slot_mapping=slots, positions=positions,
                   num_decodes=int(np.count_nonzero(q == 1)), device=device)
        return step, (ends - 1).tolist()


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

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the step's tokens -> [T, H, D].
        k and v None: `rotary_store` has written them into the cache already."""
        raise NotImplementedError

    def fuses_rotary_store(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether `rotary_store` serves this step's fused qkv projection [T,
        (H + 2 Hkv) * D] and cache: the rotary embedding and the cache write in
        one launch, before `forward` with k and v None."""
        return False

    def rotary_store(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """q rotated in place in qkv, the rotated keys and the values written
        at meta.slot_mapping (where `fuses_rotary_store`)."""
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
    if isinstance(tables, TableRows):
        return tables.padded
    padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    return padded

