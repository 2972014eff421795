"""Decode steps replayed from CUDA graphs (off with `--enforce-eager`).

At a decode step the work is fixed by the batch size, and launching each
layer's kernels from Python costs more than the kernels themselves at small
batches. So the forward of a decode-only step is captured once per bucket of
batch sizes (1, 2, 4, 8, ... up to max_num_seqs) on persistent input buffers,
and a step pads its batch to the next bucket and replays:

- padding rows take token 0 at position 0, write to slot -1 (nothing
  written) and see one key (of block 0: read, never written);
- the attention's decode plan is fixed at capture for `max_model_len`
  contexts (splits that start past a sequence's context exit at once);
- the step's ids, positions, slots and context lengths go to the device in
  one copy, its block tables in a second, and the hidden states come back as
  a view of the graph's output.

Prefill and mixed steps, and batches above the largest bucket, run eagerly.
Which bucket and what padding is plain logic, tested on the CPU with an eager
stand-in for the capture (`graph_factory`); the capture itself needs CUDA.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from folio.model.attention.backend import (AttentionBackend, StepDescription, padded_tables,
                                          staged)

logger = logging.getLogger("folio")


def capture_graphs(runner) -> Optional["DecodeGraphs"]:
    """Decode steps from CUDA graphs, on CUDA with a backend that has a fixed
    decode plan, unless --enforce-eager, LoRA or a pipeline stage (eager)."""
    if (runner.device.type != "cuda" or runner.config.enforce_eager
            or not runner.attn_backend.supports_graphs or runner.loras is not None
            or not runner.model.stage.whole):
        return None
    sched = runner.config.scheduler
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.attn_backend,
                          capture_sizes(sched.max_num_seqs),
                          -(-sched.max_model_len // runner.block_size), sched.max_model_len,
                          runner.device)
    graphs.capture()
    logger.info("CUDA graphs captured for decode batches of %s", graphs.sizes)
    return graphs


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size that holds n sequences (None: none does)."""
    return next((s for s in sizes if s >= n), None)


class CudaGraphFactory:
    """Captures `fn` into a CUDA graph sharing one memory pool across buckets."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]):
        """(replay callable, the output tensor the graph writes)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend: type[AttentionBackend],
                 sizes: list[int], max_blocks: int, max_context: int, device: torch.device,
                 graph_factory=None):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes, self.max_context, self.device = sizes, max_context, device
        largest = sizes[-1]
        # rows: input ids, positions, slots, context lengths
        self.inputs = torch.zeros(4, largest, dtype=torch.int64, device=device)
        self.tables = torch.zeros(largest, max_blocks, dtype=torch.int64, device=device)
        self.factory = graph_factory or CudaGraphFactory(device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = 0                # steps served from a graph (for tests, benchmarks)
        self.padded_rows = 0            # rows of padding those steps ran

    def _forward(self, b: int) -> torch.Tensor:
        ids, positions, slots, ctx = self.inputs[:, :b]
        meta = self.backend.graph_metadata(slots, self.tables[:b], ctx, self.max_context)
        return self.model(ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first (the others reuse its memory)."""
        self.inputs[2].fill_(-1)
        self.inputs[3].fill_(1)
        for b in reversed(self.sizes):
            self._forward(b)            # warm-up: compiles the kernels outside the capture
            self.graphs[b] = self.factory.capture(lambda b=b: self._forward(b))

    def fits(self, step: StepDescription) -> bool:
        return (step.num_decodes == len(step.query_lens)
                and bucket_for(step.num_decodes, self.sizes) is not None)

    def run(self, step: StepDescription, input_ids: np.ndarray, fill=None) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode-only step of n sequences;
        `fill` puts the last step's samples in place of placeholder ids."""
        n = len(step.query_lens)
        b = bucket_for(n, self.sizes)
        host = np.zeros((4, b), dtype=np.int64)
        host[2, n:] = -1            # padding rows write nothing
        host[3, n:] = 1             # and see one key
        host[0, :n] = input_ids
        host[1, :n] = step.positions
        host[2, :n] = step.slot_mapping
        host[3, :n] = step.positions + 1
        tables = padded_tables(step)
        width = tables.shape[1]
        self.inputs[:, :b].copy_(staged(host, self.device), non_blocking=True)
        if fill is not None:
            fill(self.inputs[0])
        self.tables[:n, :width].copy_(staged(tables, self.device), non_blocking=True)
        replay, out = self.graphs[b]
        replay()
        self.replays += 1
        self.padded_rows += b - n
        return out[:n]

