"""LoRA on the model's linear layers, several adapters in one step (issue 31).

Each adapted layer holds `max_loras` slots of stacked weights, every part's
A and B (B times the scaling) side by side, each rank zero-padded to R:

    at [slots, in, width]    A^T   (width = parts * R, padded to 16)
    bt [slots, width, out]   B^T, each part's B in its output rows

where a fused layer's parts are its checkpoint projections (qkv: q, k, v;
gate_up: gate, up) and R is --max-lora-rank. The runner lays a step's
sequences out by adapter, so each adapter's tokens are a few runs of
consecutive rows (`LoRAContext.groups`: slot, first row, end); each run adds
(x A^T) B^T to the layer's output, shrink then expand, in a grouped kernel:
native/lora.c on the CPU (fp32 sums, the output rounded once; the one-call
decoder runs it too), triton_lora.py on CUDA. Tokens of no adapter add
nothing. Where neither kernel serves, torch multiplies each run on views of
its rows (`add_lora`, slots `a` [slots, width, in] and `b` [slots, out,
width]; on the CPU in fp32, with bf16 copies for prompt chunks).
`reference_lora` is the per-token loop the tests hold them to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from folio.distributed.parallel_state import tp_rank
from folio.model.layers.linear import RowParallelLinear
from folio.kernels.native import lora as native_lora
from folio.model.lora.checkpoint import LoRAAdapter, LoRAWeights


@dataclass
class LoRAContext:
    """The step's runs of rows: (slot, first row, end) for each run of
    consecutive rows of one adapter; shared by every adapted layer. When
    every run is another slot's (a step of decodes), `batched` lays them out
    for one batched product over all slots (`batch_runs`)."""
    groups: list[tuple[int, int, int]] = field(default_factory=list)
    batched: Optional["BatchedRuns"] = None
    runs: Optional[torch.Tensor] = None         # the groups as the kernels read them
    device_runs: Optional[torch.Tensor] = None  # on a GPU: there, for Triton's
    longest: int = 0                            # the most rows of a run

    torch_products: bool = True     # some layer multiplies in torch (add_lora below)

    def set(self, groups: list[tuple[int, int, int]], num_slots: int, device) -> None:
        if not groups:          # a step of no adapter: the layers add nothing
            self.clear()
            return
        self.groups = groups
        self.batched = batch_runs(groups, num_slots, device) if self.torch_products else None
        self.runs = native_lora.runs_tensor(groups)
        self.longest = max((end - start for _, start, end in groups), default=0)
        self.device_runs = self.runs.to(device) if torch.device(device).type == "cuda" \
            else self.runs

    def clear(self) -> None:
        self.groups, self.batched, self.runs, self.device_runs, self.longest = \
            [], None, None, None, 0


@dataclass
class BatchedRuns:
    """Each slot's run of rows padded to the longest: `index` [slots, M] into
    the rows (a padding entry points at an extra zero row, number T);
    `rows` the real rows in the flattened [slots * M] order, `keep` their
    positions there."""
    index: torch.Tensor
    rows: torch.Tensor
    keep: torch.Tensor
    pad: int


def batch_runs(groups: list[tuple[int, int, int]], num_slots: int,
               device) -> Optional[BatchedRuns]:
    """The batched layout of `groups`, if there are several and no slot has
    two runs; else None (the runs then go one at a time)."""
    slots = [g[0] for g in groups]
    if len(groups) < 2 or len(set(slots)) != len(slots):
        return None
    pad = max(end for _, _, end in groups)         # the zero row's number
    longest = max(end - start for _, start, end in groups)
    index = torch.full((num_slots, longest), pad, dtype=torch.long)
    for slot, start, end in groups:
        index[slot, :end - start] = torch.arange(start, end)
    flat = index.reshape(-1)
    keep = (flat != pad).nonzero().reshape(-1)
    return BatchedRuns(index.to(device), flat[keep].to(device), keep.to(device), pad)


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             groups: list[tuple[int, int, int]], wide: Optional[tuple] = None,
             batched: Optional[BatchedRuns] = None) -> torch.Tensor:
    """y [T, out] plus, for each run's rows, (x A_slot^T) B_slot^T, computed in
    the slots' dtype; `wide`: (rows, a, b) in the run dtype, for runs of at
    least that many rows (a prompt chunk's, where the run dtype's own products
    are the fast ones)."""
    if batched is not None:
        return _add_batched(x, y, a, b, batched)
    for slot, start, end in groups:
        sa, sb = (wide[1], wide[2]) if wide is not None and end - start >= wide[0] else (a, b)
        delta = (x[start:end].to(sa.dtype) @ sa[slot].t()) @ sb[slot].t()
        y[start:end] += delta.to(y.dtype)
    return y


def _add_batched(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 batched: BatchedRuns) -> torch.Tensor:
    """Every slot's run at once: two batched products over [slots, M] rows
    (a few small products cost their dispatch, not their arithmetic)."""
    rows = x[:batched.pad].to(a.dtype)
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])[batched.index]
    delta = torch.bmm(torch.bmm(padded, a.transpose(1, 2)), b.transpose(1, 2))
    picked = delta.reshape(-1, delta.shape[-1]).index_select(0, batched.keep)
    return y.index_add_(0, batched.rows, picked.to(y.dtype))


def reference_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slots: list[Optional[int]]) -> torch.Tensor:
    """The per-token delta: row i gets B_s (A_s x_i), s its slot (None: 0)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=a.dtype)
    for i, s in enumerate(slots):
        if s is not None:
            out[i] = b[s] @ (a[s] @ x[i].to(a.dtype))
    return out


class LoRASlots:
    """One layer's slots. `parts`: (checkpoint leaf, first output row, rows,
    first row of the checkpoint's B) of each projection fused in the layer,
    in output order; `prefix`: the checkpoint module that holds them
    (model.layers.{i}.self_attn).

    Under tensor parallelism each rank holds its slice, as its base layer
    does: a column-parallel layer (input whole, output split) keeps A whole
    and its rank's rows of each part's B (KV heads replicated as the base
    replicates them); a row-parallel one (input split) keeps its rank's
    columns of A (`in_first`) and B whole: its partial (x_r A_r^T) B^T is
    added before the layer's all-reduce, which sums the ranks' partials into
    (x A^T) B^T, so no collective of its own."""

    def __init__(self, parts: list[tuple[str, int, int, int]], in_features: int,
                 out_features: int, max_loras: int, max_rank: int, dtype: torch.dtype, device,
                 context: LoRAContext, prefix: str, in_first: int = 0):
        self.parts, self.max_rank, self.context = parts, max_rank, context
        self.in_first = in_first        # this rank's first input column of A (row-parallel)
        # each part's checkpoint module: model.layers.{i}.self_attn.q_proj, ...
        self.modules = {part[0]: f"{prefix}.{part[0]}" for part in parts}
        width = len(parts) * max_rank
        self.kernel = _kernel(device, dtype)
        self.transposed = self.kernel is not None
        if self.transposed:
            # the kernels' transposed slots (native/lora.c, triton_lora.py), in
            # the run dtype, width padded
            width = -(-width // native_lora.WIDTH_MULTIPLE) * native_lora.WIDTH_MULTIPLE
            self.at = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
            self.bt = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
            return
        # torch on the CPU: fp32 slots for few rows, and the run dtype's for many
        narrow = torch.float32 if torch.device(device).type == "cpu" else dtype
        self.a = torch.zeros(max_loras, width, in_features, dtype=narrow, device=device)
        self.b = torch.zeros(max_loras, out_features, width, dtype=narrow, device=device)
        self.wide = None if narrow == dtype else (
            WIDE_ROWS, torch.zeros_like(self.a, dtype=dtype), torch.zeros_like(self.b, dtype=dtype))

    def set_slot(self, slot: int, modules: dict[str, LoRAWeights], scaling: float) -> None:
        """The slot holds this layer's part of an adapter (`modules`: leaf ->
        weights; a part it does not adapt stays zero)."""
        if self.transposed:
            in_features, width, out = self.at.shape[1], self.at.shape[2], self.bt.shape[2]
        else:
            width, in_features, out = self.a.shape[1], self.a.shape[2], self.b.shape[1]
        a = torch.zeros(width, in_features)
        b = torch.zeros(out, width)
        for i, (leaf, first, rows, source) in enumerate(self.parts):
            w = modules.get(leaf)
            if w is None:
                continue
            r, col = w.rank, i * self.max_rank
            a[col:col + r] = w.a[:, self.in_first:self.in_first + in_features]
            b[first:first + rows, col:col + r] = w.b[source:source + rows].float() * scaling
        if self.transposed:
            self.at[slot] = a.t()
            self.bt[slot] = b.t()
            return
        self.a[slot] = a
        self.b[slot] = b
        if self.wide is not None:
            self.wide[1][slot] = a
            self.wide[2][slot] = b

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        if not ctx.groups:
            return y
        if self.kernel == "native":
            return native_lora.add_lora(x, y, self.at, self.bt, ctx.runs)
        if self.kernel == "triton":
            from folio.kernels import triton_lora
            return triton_lora.add_lora(x, y, self.at, self.bt, ctx.device_runs, ctx.longest)
        return add_lora(x, y, self.a, self.b, ctx.groups, self.wide, ctx.batched)


def _kernel(device, dtype: torch.dtype) -> Optional[str]:
    """The grouped kernel adapted layers run: "native" on the CPU (where it
    builds), "triton" on CUDA; None: torch's products."""
    if native_lora.serves(device, dtype):
        return "native"
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        return "triton"
    return None


WIDE_ROWS = 64      # a run of this many rows multiplies in the run dtype (CPU)

# each Llama-style layer's adapted linear layers: (path in the decoder layer,
# its parts' checkpoint leaves)
ADAPTED = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("self_attn.o_proj", ("o_proj",)),
           ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
           ("mlp.down_proj", ("down_proj",)))


def attach_lora(model, max_loras: int, max_rank: int, dtype: torch.dtype,
                device) -> tuple[LoRAContext, list[LoRASlots]]:
    """Slots on every adapted linear layer of the model's decoder layers (a
    layer without a dense MLP, a mixture of experts', keeps its attention's),
    each knowing its checkpoint modules (`LoRASlots.modules`); and the
    context they share."""
    context = LoRAContext()
    layers: list[LoRASlots] = []
    for i, layer in enumerate(model.model.layers):
        for path, leaves in ADAPTED:
            try:
                linear = layer.get_submodule(path)
            except AttributeError:
                continue
            parts, first = [], 0
            for leaf, rows, source in zip(leaves, _part_rows(linear, leaves),
                                          _part_sources(linear, leaves)):
                parts.append((leaf, first, rows, source * rows))
                first += rows
            row_parallel = isinstance(linear, RowParallelLinear)
            linear.lora = LoRASlots(parts, linear.in_features, linear.out_features, max_loras,
                                    max_rank, dtype, device, context,
                                    f"model.layers.{i}.{path.split('.')[0]}",
                                    tp_rank() * linear.in_features if row_parallel else 0)
            layers.append(linear.lora)
    context.torch_products = any(layer.kernel is None for layer in layers)
    return context, layers


def _part_sources(linear, leaves) -> list[int]:
    """Which slice of each part's checkpoint rows this rank holds (its rank;
    for k and v, the KV head group it replicates); 0 for a row-parallel layer."""
    if isinstance(linear, RowParallelLinear):
        return [0] * len(leaves)
    if len(leaves) == 3:
        return [tp_rank()] + [tp_rank() // linear.kv_replicas] * 2
    return [tp_rank()] * len(leaves)


def _part_rows(linear, leaves) -> list[int]:
    """Output rows of each part of a fused layer, on this rank."""
    if len(leaves) == 1:
        return [linear.out_features]
    if len(leaves) == 3:            # q, k, v
        d = linear.head_dim
        return [linear.num_heads * d, linear.num_kv_heads * d, linear.num_kv_heads * d]
    return [linear.out_features // 2] * 2


def load_into_slot(layers: list[LoRASlots], slot: int, adapter: LoRAAdapter) -> None:
    """An adapter into `slot` of every adapted layer (the layers it does not
    adapt get zeros there); its modules were checked against `modules`."""
    for layer in layers:
        layer.set_slot(slot, {leaf: adapter.modules[m] for leaf, m in layer.modules.items()
                              if m in adapter.modules}, adapter.scaling)
