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

Steps with prompt tokens (prefill and mixed) are replayed piecewise
(`PiecewiseGraphs`): their attention depends on each sequence's lengths, so
it runs eagerly, and everything between two attentions (o_proj, add + norm,
the MLP, the next layer's norm, qkv projection, rotary and cache write) is
captured per bucket of token counts (16, 32, ... up to 512, or
max_num_batched_tokens if less): layers + 1 graphs a bucket, the attention writing
into one persistent buffer that the next piece reads. Padding tokens take id
0 at position 0 and write to slot -1; the attention sees the real tokens
only. Steps above the largest bucket run eagerly. (The pieces' memory is
not in the KV cache's sizing: about 2 x 512 tokens x (q, k, v, residual)
a layer, some 0.5 GB on Llama-3-8B.)

Which bucket and what padding is plain logic, tested on the CPU with an eager
stand-in for the capture (`graph_factory`); the capture itself needs CUDA.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import numpy as np
import torch

from folio.model.attention.backend import (AttentionBackend, StepDescription, padded_tables,
                                          staged)

logger = logging.getLogger("folio")


def _graphs_serve(runner) -> bool:
    """On CUDA with a backend that has a fixed decode plan, unless
    --enforce-eager, LoRA or a pipeline stage (eager)."""
    return not (runner.device.type != "cuda" or runner.config.enforce_eager
                or not runner.attn_backend.supports_graphs or runner.loras is not None
                or not runner.model.stage.whole)


def capture_piecewise(runner) -> Optional["PiecewiseGraphs"]:
    """Steps with prompt tokens from piecewise graphs, where decode graphs are
    taken and the model's layers come in pieces (`PiecewiseGraphs.serves`)."""
    if not _graphs_serve(runner) or not PiecewiseGraphs.serves(runner.model) or \
            os.environ.get("FOLIO_PIECEWISE_GRAPHS", "1") == "0":
        return None
    sched = runner.config.scheduler
    try:
        pieces = PiecewiseGraphs(runner.model, runner.kv_caches, runner.attn_backend,
                                 piecewise_sizes(min(sched.max_num_batched_tokens,
                                                     PIECEWISE_MAX_TOKENS)), runner.device)
        pieces.capture()
    except Exception as e:      # noqa: BLE001 - new on the cards: eager beats no server
        logger.warning("piecewise CUDA graphs could not be captured (%s: %s): steps with "
                       "prompt tokens run eagerly", type(e).__name__, e)
        torch.cuda.synchronize()
        return None
    logger.info("CUDA graphs captured piecewise for steps of %s tokens", pieces.sizes)
    return pieces


# Steps of more tokens run eagerly: their products outweigh the launches, and
# each bucket's pieces hold their outputs (q, k, v, residual a layer).
PIECEWISE_MAX_TOKENS = 512


def piecewise_sizes(max_tokens: int, smallest: int = 16) -> list[int]:
    """16, 32, 64, ... below max_tokens, then max_tokens itself."""
    sizes, b = [], smallest
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


def capture_graphs(runner) -> Optional["DecodeGraphs"]:
    """Decode steps from CUDA graphs, on CUDA with a backend that has a fixed
    decode plan, unless --enforce-eager, LoRA or a pipeline stage (eager)."""
    if not _graphs_serve(runner):
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
        """(replay callable, the output the graph writes: a tensor, or a tuple
        of tensors and Nones)."""
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



class _Slots:
    """What a piece's layers read of the step's metadata: the slots that the
    fused rotary + cache write takes (a persistent buffer)."""

    def __init__(self, slot_mapping: torch.Tensor):
        self.slot_mapping = slot_mapping


class PiecewiseGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend: type[AttentionBackend],
                 sizes: list[int], device: torch.device, graph_factory=None):
        self.model, self.kv_caches, self.sizes, self.device = model, kv_caches, sizes, device
        inner = model.model
        self.layers = list(inner.stage.owned(inner.layers))
        largest = sizes[-1]
        self.inputs = torch.zeros(3, largest, dtype=torch.int64, device=device)  # ids, pos, slots
        attn = self.layers[0].self_attn
        # every layer's attention writes here; the piece after it reads it
        self.attn_out = torch.zeros(largest, attn.num_heads, attn.head_dim,
                                    dtype=inner.embed_tokens.dtype, device=device)
        self.factory = graph_factory or CudaGraphFactory(device)
        # per bucket: the pieces' (replay, outputs), layers + 1 of them
        self.pieces: dict[int, list[tuple[Callable[[], None], tuple]]] = {}
        self.replays = 0
        self.padded_rows = 0

    @staticmethod
    def serves(model) -> bool:
        """Whether every layer comes in pieces around its attention (Llama's
        layers and the families that keep its forward)."""
        from folio.model.llama import LlamaAttention, LlamaDecoderLayer
        inner = getattr(model, "model", None)
        layers = list(inner.stage.owned(inner.layers)) if inner is not None else []
        return bool(layers) and inner.embed_tokens is not None and inner.norm is not None \
            and all(isinstance(layer, LlamaDecoderLayer)
                    and type(layer).forward is LlamaDecoderLayer.forward
                    and type(layer.self_attn).forward is LlamaAttention.forward
                    for layer in layers)

    def _piece(self, b: int, i: int, carried: tuple):
        """Piece i of bucket b: the layer before it after its attention (none
        for i = 0: the embedding), then layer i up to its attention (for the
        last piece: the final norm). carried: (cos, sin, residual) from piece
        i - 1."""
        inner = self.model.model
        ids, positions, slots = self.inputs[:, :b]
        if i == 0:
            hidden, residual = inner.embed_tokens(ids), None
            cos, sin = inner.rotary(positions)
        else:
            cos, sin, residual = carried
            hidden, residual = self.layers[i - 1].after_attention(self.attn_out[:b], residual)
        if i == len(self.layers):
            return (inner.norm(hidden, residual)[0],)
        q, k, v, residual = self.layers[i].before_attention(
            (cos, sin), hidden, residual, self.kv_caches[i], _Slots(slots))
        return cos, sin, residual, q, k, v

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first (the others reuse its memory); each
        piece warmed up eagerly first (kernels compiled outside the capture)."""
        self.inputs.zero_()
        self.inputs[2].fill_(-1)
        for b in reversed(self.sizes):
            pieces, carried = [], ()
            for i in range(len(self.layers) + 1):
                self._piece(b, i, carried)
                replay, outs = self.factory.capture(
                    lambda b=b, i=i, c=carried: self._piece(b, i, c))
                pieces.append((replay, outs))
                carried = outs[:3]
            self.pieces[b] = pieces

    def fits(self, step: StepDescription) -> bool:
        return bucket_for(len(step.slot_mapping), self.sizes) is not None

    def run(self, step: StepDescription, input_ids: np.ndarray, meta,
            fill=None) -> torch.Tensor:
        """The hidden states [T, hidden] of a step of T tokens (any mix of
        decodes and prompt chunks): the pieces replayed, the attention of
        each layer run eagerly on the real tokens between them."""
        n = len(step.slot_mapping)
        b = bucket_for(n, self.sizes)
        host = np.zeros((3, b), dtype=np.int64)
        host[2, n:] = -1            # padding tokens write nothing
        host[0, :n] = input_ids
        host[1, :n] = step.positions
        host[2, :n] = step.slot_mapping
        self.inputs[:, :b].copy_(staged(host, self.device), non_blocking=True)
        if fill is not None:
            fill(self.inputs[0])
        pieces = self.pieces[b]
        for i, layer in enumerate(self.layers):
            replay, (_, _, _, q, k, v) = pieces[i]
            replay()
            layer.self_attn.attn.forward(q[:n], None if k is None else k[:n],
                                         None if v is None else v[:n], self.kv_caches[i], meta,
                                         out=self.attn_out[:n])
        replay, (hidden,) = pieces[-1]
        replay()
        self.replays += 1
        self.padded_rows += b - n
        return hidden[:n]
