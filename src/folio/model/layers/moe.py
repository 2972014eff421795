"""The fused mixture-of-experts layer: a router and every expert's weights stacked.

Each token goes to its top-k experts (softmax over all experts, the k best,
renormalized over those k where the model says so) and its output is the
router-weighted sum of their SwiGLU MLPs. The experts are two stacked tensors:

    w13  [E, 2 * I, H]   gate rows then up rows of every expert
    w2   [E, H, I]       down projection of every expert

A step's T tokens become T * k (token, expert) rows, sorted by expert; each
expert with rows runs one matmul pair over all of them, so its weights are read
once per step whatever the number of tokens that chose it; the rows are then
weighted and scattered back to their tokens (`fused_experts`). Under CUDA graph
capture the row counts cannot be read back, so every expert runs on every
token and the unchosen outputs are weighted by zero (`dense_experts`: still
each expert's weights once per step). On CUDA, float experts run on the Triton
kernel (triton_moe.py), which groups the rows on the device and so needs no
host read, captured or not. `reference_experts` is the plain
per-token loop the tests hold both to. On the CPU, once loaded, each expert's
two matrices are packed as the dense layers' are (`packed_experts`); under
`--quantization int8|int4` (on any device) they are quantized instead, round
to nearest as rtn.py quantizes every linear layer, and run on IntGroups'
kernels, their activations as `--activation-quantization` says; a GGUF's
packable experts arrive in their codes (gguf.py's tensors, stacked by expert:
`_gguf_tensors`) and run on the same kernels, never held as floats; a
checkpoint whose experts are stored quantized (GPTQ, AWQ, compressed-tensors)
loads them through per-expert layers of its format's method and keeps their
IntGroups (expert_weights.py, which says how every expert matrix is held).

Tensor parallelism splits I: each rank holds a slice of every expert's gate,
up and down (column-parallel w13, row-parallel w2) and the partial outputs are
all-reduced, as the dense MLP does; the router is replicated, so every rank
routes alike.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.distributed.parallel_state import all_reduce, tp_rank, tp_size
from folio.kernels import native
from folio.model.layers.activation import silu_and_mul
from folio.model.layers.expert_weights import ExpertMatrix, checkpoint_experts, prepared
from folio.model.layers.quantization.int_groups import has_triton


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_float: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E]: softmax in
    fp32 over all experts, then the k best. `weights_in_float`: the weights stay
    fp32 (Mixtral multiplies in fp32), else they take the logits' dtype
    (Qwen3-MoE), as transformers does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_in_float else weights.to(logits.dtype)), ids


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            packed: Optional[tuple] = None) -> torch.Tensor:
    """One expert's SwiGLU MLP on rows x [N, H] -> [N, H] (`packed`: its two
    matrices as the CPU's packed products take them, FusedMoE.packed_experts)."""
    if packed is not None:
        return packed[1](silu_and_mul(packed[0](x, None)), None)
    return F.linear(silu_and_mul(F.linear(x, w13)), w2)


def _silu_and_mul_any(h: torch.Tensor) -> torch.Tensor:
    """silu_and_mul over the last dim of a tensor of any rank."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  packed: Optional[list] = None) -> torch.Tensor:
    """x [T, H] through its chosen experts, grouped by expert -> [T, H]
    (`packed`: every expert's packed matrices, in place of w13 and w2). One
    token (a decode step of one request) has nothing to group: its experts run
    in turn, without the sort and scatter (`one_token_experts`)."""
    if x.shape[0] == 1:
        return one_token_experts(x, w13, w2, weights, ids, packed)
    return grouped_experts(x, w13, w2, weights, ids, packed)


def one_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor,
                      packed: Optional[list] = None) -> torch.Tensor:
    """x [1, H] through its k experts in turn: the sum grouped_experts makes,
    in its order (ascending expert id, each term rounded to x's dtype, added
    in fp32 and rounded once, as torch's index_add_ adds bf16 rows on the
    CPU), so on the CPU the two agree bit for bit."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, j in sorted(zip(ids[0].tolist(), range(ids.shape[1]))):
        y = _expert(x, w13[e], w2[e]) if packed is None else _expert(x, None, None, packed[e])
        acc += (y * weights[0, j:j + 1]).to(x.dtype)
    return acc.to(x.dtype)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor,
                    packed: Optional[list] = None) -> torch.Tensor:
    """x [T, H]'s (token, expert) rows sorted by expert, each chosen expert run
    once on all of its rows, the outputs weighted and added back to their
    tokens -> [T, H]."""
    k = ids.shape[1]
    flat = ids.reshape(-1)                                   # [T * k], row r = (r // k, r % k)
    order = torch.argsort(flat, stable=True)                 # rows sorted by expert id
    tokens = order // k                                      # [T * k] the token of each row
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[tokens]                                         # [T * k, H]
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = (_expert(rows[start:start + n], w13[e], w2[e]) if packed is None
                                    else _expert(rows[start:start + n], None, None, packed[e]))
            start += n
    scaled = (out * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)


def dense_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, the unchosen weighted by zero: no host read
    (CUDA graph capture), for the small batches of decode steps."""
    gate = torch.zeros(x.shape[0], w13.shape[0], dtype=weights.dtype, device=x.device)
    gate.scatter_(1, ids, weights)                           # [T, E]
    h = torch.einsum("th,eih->eti", x, w13)                  # [E, T, 2I]
    y = torch.einsum("eti,ehi->eth", _silu_and_mul_any(h), w2)  # [E, T, H]
    return torch.einsum("eth,te->th", y.to(gate.dtype), gate).to(x.dtype)


def dense_packed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor,
                         packed: list) -> torch.Tensor:
    """dense_experts for packed or quantized experts (under CUDA graph capture,
    where fused_experts' host read of the counts cannot run): every expert on
    every token, the unchosen weighted by zero."""
    gate = torch.zeros(x.shape[0], len(packed), dtype=weights.dtype, device=x.device)
    gate.scatter_(1, ids, weights)                           # [T, E]
    out = torch.zeros_like(x)
    for e, matrices in enumerate(packed):
        out += (_expert(x, None, None, matrices) * gate[:, e:e + 1]).to(x.dtype)
    return out


def reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The per-token loop: token i is sum_j weights[i, j] * expert_{ids[i, j]}(x_i)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            gate, up = F.linear(x[i], w13[e]).chunk(2)
            y = F.linear(F.silu(gate) * up, w2[e])
            out[i] += (y * weights[i, j]).to(x.dtype)
    return out


class Router(nn.Module):
    """The replicated router: logits = x W^T, W [E, H], in the run dtype.

    A bf16 router on the CPU multiplies in fp32 on an fp32 copy of W (`w32`,
    made once loaded; E x H is small) and rounds the logits to bf16: what a
    bf16 product computes (exact products, fp32 sums, one rounding), but a
    product of a few rows by E outputs costs oneDNN's bf16 path 18.6 us
    against 2.3 us in fp32 on an AMX CPU, and one such call in each MoE layer
    was 13% of a one-request decode step (issue 29)."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype),
                                   requires_grad=False)
        self.w32: Optional[torch.Tensor] = None

    def prepare(self) -> None:
        if self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu":
            self.w32 = self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w32 is not None and x.dtype == torch.bfloat16:
            return F.linear(x.float(), self.w32).to(x.dtype)
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """Router plus stacked experts, loaded from per-expert checkpoint tensors.

    `checkpoint_prefix` is where the block lives in the checkpoint (e.g.
    "model.layers.0.block_sparse_moe"), `names` its experts' (gate, up, down)
    tensor names ("w1", "w3", "w2" for Mixtral). Each stacked parameter says
    which checkpoint tensors fill it (`checkpoint_names`, shard -> name), which
    the generic loader reads to route them and to name the missing ones.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, dtype: torch.dtype, checkpoint_prefix: str,
                 names: tuple[str, str, str], weights_in_float: bool = False,
                 quant_config=None):
        super().__init__()
        # --quantization int8|int4 (rtn.py's RTNConfig): the experts load as floats,
        # in the checkpoint's dtype, and are quantized once loaded
        # (and --quantization fp8: fp8.py's Fp8Config, e4m3 codes per expert matrix)
        from folio.model.layers.quantization.fp8 import Fp8Config
        from folio.model.layers.quantization.rtn import RTNConfig
        self.rtn = quant_config if isinstance(quant_config, (RTNConfig, Fp8Config)) else None
        # --dtype bfloat16 on a CPU without native bf16: fp32 experts kept as bf16
        # for the AVX2 kernel, as the dense layers' (pack_weight's `store`)
        self.store = None if quant_config is None else quant_config.weight_dtype
        experts_dtype = (self.rtn.load_dtype if self.rtn is not None and self.rtn.load_dtype
                         else dtype)       # the router keeps the run dtype
        self.tp = tp_size()
        if intermediate % self.tp:
            raise ValueError(f"the experts' intermediate size ({intermediate}) is not divisible "
                             f"by the tensor-parallel size ({self.tp})")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.weights_in_float = renormalize, weights_in_float
        self.intermediate = intermediate // self.tp          # this rank's slice of I
        self.gate = Router(hidden, num_experts, dtype)
        # a GGUF's experts kept in their codes (each matrix's tensors as gguf.py
        # reads a linear layer's, stacked by expert), or a checkpoint's stored
        # quantized (GPTQ, AWQ, compressed-tensors: per-expert linear layers of
        # the format's method, until loaded): no float stacks are made then
        methods = getattr(quant_config, "expert_methods", None)
        self.gguf = methods(checkpoint_prefix.rsplit(".", 1)[0]) if methods else None
        in_codes = quant_config is not None and not quant_config.loads_float_weights \
            and methods is None
        floats = self.gguf is None and not in_codes
        self.w13_weight = nn.Parameter(
            torch.empty((num_experts, 2 * self.intermediate, hidden) if floats else (0,),
                        dtype=experts_dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty((num_experts, hidden, self.intermediate) if floats else (0,),
                        dtype=experts_dtype), requires_grad=False)
        gate, up, down = (f"{checkpoint_prefix}.experts.{{}}.{n}.weight" for n in names)
        self.gate.weight.checkpoint_names = {None: f"{checkpoint_prefix}.gate.weight"}
        self.w13_weight.checkpoint_names = {
            (e, part): name.format(e) for e in range(num_experts)
            for part, name in ((0, gate), (1, up))}
        self.w2_weight.checkpoint_names = {e: down.format(e) for e in range(num_experts)}
        self.packed_experts: Optional[list] = None     # process_weights_after_loading's
        self.w13_weight.weight_loader = self._load_w13
        self.w2_weight.weight_loader = self._load_w2
        if self.gguf is not None:
            self._gguf_tensors(hidden, checkpoint_prefix, names)
        self.experts: Optional[nn.ModuleList] = None
        if in_codes:
            self._checkpoint_experts(hidden, intermediate, dtype, quant_config,
                                     checkpoint_prefix, names)

    def _gguf_tensors(self, hidden: int, prefix: str, names: tuple[str, str, str]) -> None:
        """The stacked experts' GGUF tensors in place of the float ones: w13_<t>
        [E, 2 I, columns] and w2_<t> [E, H, columns], t each of gguf.py's
        checkpoint tensors, filled from `{prefix}.experts.{e}.{name}.<t>`."""
        self.w13_weight.checkpoint_names = self.w2_weight.checkpoint_names = {}
        n, experts = self.intermediate, self.num_experts
        for matrix, method, inputs in (("w13", self.gguf[0], hidden), ("w2", self.gguf[1], n)):
            if inputs % method.group or inputs % (8 // method.bits):
                raise ValueError(f"{method.prefix}: {inputs} input features per rank do not "
                                 f"split into {method.kind}'s groups of {method.group}")
            rows = 2 * n if matrix == "w13" else hidden
            for t in method.checkpoint_tensors:
                columns = inputs // (8 // method.bits) if t == "qcodes" else inputs // method.group
                param = nn.Parameter(torch.empty(experts, rows, columns,
                                                 dtype=torch.uint8 if t == "qcodes"
                                                 else torch.float32), requires_grad=False)
                if matrix == "w13":
                    param.checkpoint_names = {
                        (e, part): f"{prefix}.experts.{e}.{names[part]}.{t}"
                        for e in range(experts) for part in (0, 1)}
                    param.weight_loader = self._load_w13
                else:
                    param.checkpoint_names = {e: f"{prefix}.experts.{e}.{names[2]}.{t}"
                                              for e in range(experts)}
                    param.weight_loader = self._load_w2
                self.register_parameter(f"{matrix}_{t}", param)

    def _checkpoint_experts(self, hidden: int, intermediate: int, dtype: torch.dtype,
                            quant_config, prefix: str, names: tuple[str, str, str]) -> None:
        """Each expert's matrices as linear layers of the format's method
        (expert_weights.checkpoint_experts); the float stacks are not made."""
        self.w13_weight.checkpoint_names = self.w2_weight.checkpoint_names = {}
        self.experts = checkpoint_experts(self.num_experts, hidden, intermediate, dtype,
                                          quant_config, prefix, names)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard) -> None:
        """Expert e's gate (part 0) or up (part 1) [I, H]: this rank's rows."""
        e, part = shard
        n = self.intermediate
        _copy(param.data[e, part * n:(part + 1) * n], loaded.narrow(0, tp_rank() * n, n))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, e: int) -> None:
        """Expert e's down [H, I] (or a GGUF tensor of it): this rank's columns."""
        n = param.shape[2]
        _copy(param.data[e], loaded.narrow(1, tp_rank() * n, n))

    def process_weights_after_loading(self) -> None:
        """Each expert's two matrices, once loaded: quantized (int8|int4|fp8), or on
        the CPU packed as the dense layers' are (`pack_weight`: oneDNN's layout,
        or the native kernel's; a bf16 product on an unpacked weight lays it out
        anew on every call, 2.3x the time of the packed one at one token on an AMX
        CPU; fp32 experts stored as bf16 under `store`). Only those forms are
        kept; the stacked parameters stay, empty, for their names."""
        self.gate.prepare()
        if self.gguf is not None:
            tensors = [{t: getattr(self, f"{matrix}_{t}") for t in method.checkpoint_tensors}
                       for matrix, method in zip(("w13", "w2"), self.gguf)]
            self.packed_experts = [
                tuple(ExpertMatrix(method.held({t: p.data[e] for t, p in named.items()}))
                      for method, named in zip(self.gguf, tensors))
                for e in range(self.num_experts)]
            for named in tensors:
                for p in named.values():
                    p.data = torch.empty(0, dtype=p.dtype)
            return
        if self.experts is not None:
            self.packed_experts = [tuple(prepared(layer) for layer in (x.gate_up_proj, x.down_proj))
                                   for x in self.experts]
            self.experts = None         # only the packed forms are kept
            return
        if self.rtn is not None:
            packed = [(self._quantized(self.w13_weight.data[e], 0),
                       self._quantized(self.w2_weight.data[e], tp_rank() * self.intermediate))
                      for e in range(self.num_experts)]
        elif self.w13_weight.device.type == "cpu":
            from folio.model.layers.linear import pack_weight
            packed = [(pack_weight(self.w13_weight.data[e], self.store),
                       pack_weight(self.w2_weight.data[e], self.store))
                      for e in range(self.num_experts)]
            if any(a is None or b is None for a, b in packed):
                return
        else:
            return
        self.packed_experts = packed
        for param in (self.w13_weight, self.w2_weight):
            param.data = torch.empty(0, dtype=param.dtype)

    def _quantized(self, weight: torch.Tensor, first_input: int):
        """One expert matrix [out, in] in RTN's codes (`first_input`: where this
        rank's inputs start on the checkpoint's axis, for the groups), or fp8's."""
        from folio.model.layers.quantization import fp8
        if isinstance(self.rtn, fp8.Fp8Config):
            codes, scales = fp8.quantize(weight, "experts: fp8")
            return fp8.Fp8Linear(codes, scales, weight.shape[1])
        from folio.model.layers.quantization.int_groups import IntGroups
        from folio.model.layers.quantization.rtn import group_of_inputs, quantize
        groups = group_of_inputs(weight.shape[1], self.rtn.group_size, first_input)
        codes, scale, zero = quantize(weight, groups, self.rtn.bits, self.rtn.sym,
                                      f"experts: {self.rtn.name}")
        return ExpertMatrix(IntGroups.from_codes(codes, groups, scale, self.rtn.bits,
                                                 zero=zero))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): a bf16 run on the CPU routes in
        one native call (native/moe.c), which the one-call decoder makes too,
        so that the two route alike; otherwise the Router and `route`."""
        w32 = self.gate.w32
        if w32 is not None and native.fuses(x) and x.dim() == 2 \
                and self.num_experts <= native.MAX_ROUTED_EXPERTS:
            return native.moe_route(x, w32, self.top_k, self.renormalize, self.weights_in_float)
        return route(self.gate(x), self.top_k, self.renormalize, self.weights_in_float)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        w13, w2, packed = self.w13_weight, self.w2_weight, self.packed_experts
        if x.is_cuda and packed is None and has_triton():
            # no host read: the same launch under CUDA graph capture
            from folio.kernels.triton_moe import triton_fused_experts
            out = triton_fused_experts(x, w13, w2, weights, ids)
        elif not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            out = fused_experts(x, w13, w2, weights, ids, packed)
        elif packed is None:
            out = dense_experts(x, w13, w2, weights, ids)
        else:
            out = dense_packed_experts(x, w13, w2, weights, ids, packed)
        return all_reduce(out, self.tp)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit "
                         f"the expert's slice of shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))
