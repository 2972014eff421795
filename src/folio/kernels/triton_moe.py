"""The fused mixture-of-experts product in Triton: what a MoE layer's float
experts run on CUDA (moe.py's FusedMoE).

The step's T tokens make T * k (token, expert) rows, row r = token * k + j.
`align_by_expert` sorts them by expert and pads each expert's run to whole
blocks of BLOCK_M rows (padding rows are -1), all on the device: no count is
read back, so the same launch serves every step and a CUDA graph captures it
(the grid is the most blocks any routing can need, T * k rows plus one
partial block per expert that has rows; the blocks past the last expert's are
marked -1 and return at once). Each program of `_expert_matmul` multiplies
one block of rows by one expert's weight [N, K] for a BLOCK_N slice of N: the
expert's weights are read once per block of its rows, not once per token.

Two launches make the experts' SwiGLU MLP: gate-and-up (rows read from x
[T, H] at r // k) into h [T * k, 2I], silu(gate) * up, then down (rows of
the activations at r), each output row scaled by its routing weight and
rounded to the activations' dtype; the k rows of a token are added in fp32
and rounded once (the sum moe.grouped_experts makes). On the CPU the kernel
runs in triton's interpreter (TRITON_INTERPRET=1), which is how the tests
hold it to moe.reference_experts; `dot_fp32` upcasts the products there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from folio.model.layers.activation import silu_and_mul


@triton.jit
def _expert_matmul(a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, weights_ptr,
                   N, K, a_stride, w_stride_e, w_stride_n, out_stride, rows_per_a,
                   MUL_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        r = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = r >= 0
        a_row = tl.where(valid, r // rows_per_a, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        w_base = w_ptr + expert * w_stride_e
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K
            a = tl.load(a_ptr + a_row[:, None] * a_stride + kk[None, :],
                        mask=valid[:, None] & km[None, :], other=0.0)
            w = tl.load(w_base + n[None, :].to(tl.int64) * w_stride_n + kk[:, None],
                        mask=km[:, None] & nm[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if MUL_WEIGHT:
            # rounded to the activations' dtype first, as a product's output is
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc *= tl.load(weights_ptr + r, mask=valid, other=0.0).to(tl.float32)[:, None]
        out_row = tl.where(valid, r, 0).to(tl.int64)
        tl.store(out_ptr + out_row[:, None] * out_stride + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nm[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [blocks * block_m] int32: the (token, slot) rows r of each block,
    -1 for padding; block_expert [blocks] int32: each block's expert, -1
    past the last) for expert ids [T, k], every expert's rows in whole blocks,
    blocks = the most any routing of T * k rows over the experts can take."""
    flat = ids.reshape(-1).to(torch.int64)
    total = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices                 # rows sorted by expert
    sorted_experts = flat[order]
    first = torch.cumsum(counts, 0) - counts                      # each expert's first sorted row
    slot = (ends - padded)[sorted_experts] + torch.arange(total, device=ids.device) \
        - first[sorted_experts]
    blocks = (total + min(num_experts, total) * (block_m - 1)) // block_m
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=ids.device)
    rows[slot] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


def _launch(a, w, out, rows, block_expert, weights, rows_per_a, dot_fp32, block_m, block_n,
            block_k):
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _expert_matmul[grid](
        a, w, out, rows, block_expert, weights if weights is not None else out,
        n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), rows_per_a,
        MUL_WEIGHT=weights is not None, DOT_FP32=dot_fp32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)


def triton_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor, dot_fp32: bool = False,
                         block_m: int = 16, block_n: int = 64,
                         block_k: int = 32) -> torch.Tensor:
    """x [T, H] through its chosen experts (w13 [E, 2I, H], w2 [E, H, I];
    weights and ids [T, k]) -> [T, H], in x's dtype."""
    t, k = ids.shape
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    rows, block_expert = align_by_expert(ids, w13.shape[0], block_m)
    dot_fp32 = dot_fp32 or x.dtype == torch.float32
    h = torch.empty(t * k, w13.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, w13, h, rows, block_expert, None, k, dot_fp32, block_m, block_n, block_k)
    act = silu_and_mul(h)
    y = torch.empty(t * k, w2.shape[1], dtype=x.dtype, device=x.device)
    _launch(act, w2, y, rows, block_expert, weights.reshape(-1).contiguous(), 1, dot_fp32,
            block_m, block_n, block_k)
    return y.view(t, k, -1).float().sum(1).to(x.dtype)
