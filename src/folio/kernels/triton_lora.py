"""The grouped LoRA products in Triton: what adapted layers run on CUDA
(issue 31), on the native kernel's slot layout (native/lora.c):

    at [slots, in, width]    A^T, width a multiple of 16
    bt [slots, width, out]   B^T, the scaling folded in

Two launches per layer, each over (run, block of its rows, block of
columns), as Punica's SGMV does: the shrink writes t = x A^T for each run's
rows (fp32, [T, width]), the expand adds t B^T into y, rounded once. A
program's run is one adapter's consecutive rows, so it reads that adapter's
weights only. On the CPU the kernels run in triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check them against the
per-token reference; `dot_fp32` upcasts the products there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_W, BLOCK_K, BLOCK_N = 16, 16, 32, 64


@triton.jit
def _block_rows(runs_ptr, BLOCK_M: tl.constexpr):
    """This program's run (axis 0) and block of its rows (axis 1): the run's
    slot, the block's first row and the run's end."""
    run = tl.program_id(0)
    slot = tl.load(runs_ptr + run * 3)
    first = tl.load(runs_ptr + run * 3 + 1) + tl.program_id(1) * BLOCK_M
    return slot, first, tl.load(runs_ptr + run * 3 + 2)


@triton.jit
def _shrink_kernel(x_ptr, at_ptr, runs_ptr, t_ptr, x_stride, in_features, width,
                   DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    slot, first, end = _block_rows(runs_ptr, BLOCK_M)
    m = first + tl.arange(0, BLOCK_M)
    if first < end:
        w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
        k = tl.arange(0, BLOCK_K)
        mm = m < end
        acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
        base = at_ptr + slot * in_features * width
        for k0 in range(0, in_features, BLOCK_K):
            km = k0 + k < in_features
            x = tl.load(x_ptr + m[:, None] * x_stride + (k0 + k)[None, :],
                        mask=mm[:, None] & km[None, :], other=0.0)
            a = tl.load(base + (k0 + k)[:, None] * width + w[None, :], mask=km[:, None],
                        other=0.0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a.to(x.dtype))
        tl.store(t_ptr + m[:, None] * width + w[None, :], acc, mask=mm[:, None])


@triton.jit
def _expand_kernel(t_ptr, bt_ptr, runs_ptr, y_ptr, y_stride, width, out_features,
                   DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    slot, first, end = _block_rows(runs_ptr, BLOCK_M)
    m = first + tl.arange(0, BLOCK_M)
    if first < end:
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.arange(0, BLOCK_W)
        mm, nm = m < end, n < out_features
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        base = bt_ptr + slot * width * out_features
        for w0 in range(0, width, BLOCK_W):
            t = tl.load(t_ptr + m[:, None] * width + (w0 + w)[None, :], mask=mm[:, None],
                        other=0.0)
            b = tl.load(base + (w0 + w)[:, None] * out_features + n[None, :], mask=nm[None, :],
                        other=0.0)
            if DOT_FP32:
                acc += tl.dot(t, b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(t.to(b.dtype), b)
        ptrs = y_ptr + m[:, None] * y_stride + n[None, :]
        mask = mm[:, None] & nm[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(x: torch.Tensor, y: torch.Tensor, at: torch.Tensor, bt: torch.Tensor,
             runs: torch.Tensor, longest: int, dot_fp32: bool = False) -> torch.Tensor:
    """y [T, out] += each run's (x A^T) B^T, in place. `runs` [R, 3] int64 on
    y's device (slot, first row, end); `longest`: the most rows of a run."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    in_features, width, out = at.shape[1], at.shape[2], bt.shape[2]
    if width % BLOCK_W:
        raise ValueError(f"the LoRA slots' width {width} is not a multiple of {BLOCK_W}")
    nruns = runs.shape[0]
    if nruns == 0 or longest == 0:
        return y
    t = torch.empty(y.shape[0], width, dtype=torch.float32, device=y.device)
    row_blocks = triton.cdiv(longest, BLOCK_M)
    _shrink_kernel[(nruns, row_blocks, width // BLOCK_W)](
        x, at, runs, t, x.stride(0), in_features, width, DOT_FP32=dot_fp32,
        BLOCK_M=BLOCK_M, BLOCK_W=BLOCK_W, BLOCK_K=BLOCK_K)
    _expand_kernel[(nruns, row_blocks, triton.cdiv(out, BLOCK_N))](
        t, bt, runs, y, y.stride(0), width, out, DOT_FP32=dot_fp32, BLOCK_M=BLOCK_M,
        BLOCK_W=BLOCK_W, BLOCK_N=BLOCK_N)
    return y
