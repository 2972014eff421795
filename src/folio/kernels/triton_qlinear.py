"""Weight-only 4/8-bit matmul in Triton on the `IntGroups` packed form
(int_groups.py): what quantized layers run on CUDA.

A program computes a BLOCK_M x BLOCK_N tile of y = x W^T. For each group of
positions it multiplies the activations (gathered through `perm` where the
checkpoint needs it: act-order, padded groups) by the codes as they are,
unpacked from their 32-bit words in registers, and then applies the group's
scale and offset to the sums:

    y[m, n] += scale[n, g] * sum_{p in g} x[m, p] q[n, p]
             + offset[n, g] * sum_{p in g} x[m, p]

(offset = -zero * scale where the format has zero points). The codes are
small integers, exact in fp16 and bf16, so the matmul takes them in the
activations' dtype with fp32 sums. On the CPU the kernel runs in triton's
interpreter (TRITON_INTERPRET=1), which is how the tests check it against the
dequantized weight; `dot_fp32` upcasts the matmul inputs there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE, OCTET = 16, 8


@triton.jit
def _qlinear_kernel(x_ptr, perm_ptr, codes_ptr, scales_ptr, offsets_ptr, bounds_ptr, bias_ptr,
                    y_ptr, M, N, x_stride, y_stride, num_groups, octets,
                    BITS: tl.constexpr, ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mm, nm = m < M, n < N
    tile, lane = n // 16, n % 16
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, num_groups):
        start = tl.load(bounds_ptr + g)
        end = tl.load(bounds_ptr + g + 1)
        dot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        xsum = tl.zeros([BLOCK_M], tl.float32)
        for p0 in range(start, end, BLOCK_K):
            p = p0 + k
            pm = p < end
            if HAS_PERM:
                col = tl.load(perm_ptr + p, mask=pm, other=-1)
                xm = mm[:, None] & (col >= 0)[None, :]
                x = tl.load(x_ptr + m[:, None] * x_stride + col[None, :], mask=xm, other=0.0)
            else:
                x = tl.load(x_ptr + m[:, None] * x_stride + p[None, :],
                            mask=mm[:, None] & pm[None, :], other=0.0)
            octet, r = p // 8, p % 8
            word = (tile[None, :] * octets + octet[:, None])
            if BITS == 4:
                addr = (word * 16 + lane[None, :]) * 4 + (r % 4)[:, None]
                byte = tl.load(codes_ptr + addr, mask=pm[:, None] & nm[None, :], other=0)
                q = (byte.to(tl.int32) >> (4 * (r // 4))[:, None]) & 0xF
            else:
                addr = ((word * 2 + (r // 4)[:, None]) * 16 + lane[None, :]) * 4 + (r % 4)[:, None]
                q = tl.load(codes_ptr + addr, mask=pm[:, None] & nm[None, :], other=0).to(tl.int32)
            xsum += tl.sum(x.to(tl.float32), axis=1)
            if DOT_FP32:
                dot += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            else:
                dot += tl.dot(x, q.to(x.dtype))
        sg = (tile * num_groups + g) * 16 + lane
        scale = tl.load(scales_ptr + sg, mask=nm, other=0.0).to(tl.float32)
        offset = tl.load(offsets_ptr + sg, mask=nm, other=0.0).to(tl.float32)
        if ZEROS:
            offset = -offset * scale
        acc += dot * scale[None, :] + xsum[:, None] * offset[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * y_stride + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def qlinear(x: torch.Tensor, w, bias: torch.Tensor | None = None, dot_fp32: bool = False,
            block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x [..., K] times the IntGroups weight `w` (+ bias) -> [..., N], in x's dtype."""
    if w.bits not in (4, 8) or w.supers is not None:     # packed so only for the CPU
        raise NotImplementedError("the Triton kernel reads 4- and 8-bit codes with float16 "
                                  "scales; this weight is held in the CPU kernel's 6-bit or "
                                  "two-level form")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.out_features
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    octets = w.positions // OCTET
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    perm = w.perm if w.perm is not None else w.bounds      # any pointer when unused
    _qlinear_kernel[grid](
        x2, perm, w.codes, w.scales, w.offsets, w.bounds, bias if bias is not None else y, y,
        M, N, x2.stride(0), y.stride(0), w.bounds.numel() - 1, octets,
        BITS=w.bits, ZEROS=w.zeros, HAS_PERM=w.perm is not None, HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32 or x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return y.view(*shape[:-1], N)
