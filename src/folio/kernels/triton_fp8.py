"""Weight-only fp8 (e4m3) matmul in Triton: what fp8 layers run on GPUs
without fp8 products (compute capability under 8.9), and on any GPU for
128x128 block scales, which `torch._scaled_mm`'s row scales do not take.

A program computes a BLOCK_M x BLOCK_N tile of y = x W^T from the codes as
stored ([N, K] bytes, quantization/fp8.py's Fp8Linear) and fp32 scales
[N, KB], one per output feature and block of `block` inputs:

    y[m, n] = sum over blocks b of scale[n, b] * sum_{k in b} x[m, k] e4m3(c[n, k])

A code becomes a float16 in registers: its byte sign-extended and shifted
left by 7 is the float16 with its sign, exponent and mantissa bits but a copy
of the sign in the float16's top exponent bit, which an AND clears; that is
the e4m3 value times 2^-8, exactly (subnormals included), and exact in bf16
too, so the matmul takes it in the activations' dtype with fp32 sums; the
2^8 goes into the scale. On the CPU the kernel runs in triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check it against the dequantized
weight; `dot_fp32` upcasts the matmul inputs there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_kernel(x_ptr, codes_ptr, scales_ptr, bias_ptr, y_ptr, M, N, K, x_stride, y_stride,
                blocks, block, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mm, nm = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b in range(0, blocks):
        start = b * block
        end = tl.minimum(start + block, K)
        dot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for p0 in range(start, end, BLOCK_K):
            p = p0 + k
            pm = p < end
            x = tl.load(x_ptr + m[:, None] * x_stride + p[None, :],
                        mask=mm[:, None] & pm[None, :], other=0.0)
            c = tl.load(codes_ptr + n[None, :] * K + p[:, None], mask=pm[:, None] & nm[None, :],
                        other=0)
            h = (c.to(tl.int8, bitcast=True).to(tl.int32) << 7) & 0xBFFF
            w = h.to(tl.uint16).to(tl.float16, bitcast=True)
            if DOT_FP32:
                dot += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                dot += tl.dot(x, w.to(x.dtype))
        scale = tl.load(scales_ptr + n * blocks + b, mask=nm, other=0.0) * 256.0
        acc += dot * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * y_stride + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
               bias: torch.Tensor | None = None, dot_fp32: bool = False, block_m: int = 16,
               block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """x [..., K] times the weight of e4m3 `codes` [N, K] (uint8) and fp32
    `scales` [N, ceil(K / block)] (+ bias) -> [..., N], in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, (N, K) = x2.shape[0], codes.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_kernel[grid](
        x2, codes, scales, bias if bias is not None else y, y, M, N, K, x2.stride(0),
        y.stride(0), scales.shape[1], block, HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32 or x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return y.view(*shape[:-1], N)
