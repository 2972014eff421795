"""The element-wise steps of a decoder layer fused into one launch each, for
CUDA (Triton), so that a layer runs five kernels besides its matrix
products (add + RMSNorm, rotary + KV write, attention, add + RMSNorm,
gated activation) where torch launches about thirty:

- `add_rmsnorm`: the residual add and the RMSNorm after it, one program per
  token: the sum rounded to the run dtype (the new residual stream, as
  torch's add gives it), normalized in fp32, cast back, times the weight.
- `gated_act`: SiLU(gate) x up (Llama's MLP) or GELU-tanh(gate) x up (Gemma's
  GeGLU) from the fused gate_up projection, in fp32, cast back.
- `rotary_store`: the rotate-half rotary embedding of a step's q and k heads
  in the fused qkv projection (q rotated in place), with the rotated keys
  and the values written straight into a float KV cache at their slots (a
  negative slot writes nothing): what `triton_attention.store_kv` would do
  after torch's rotation, in one launch.

Each equals the torch layer it replaces to the rounding of its dtype (the
tests hold them to it in triton's interpreter). They serve CUDA tensors;
`serves` says where.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_AVAILABLE = importlib.util.find_spec("triton") is not None
if _AVAILABLE:
    import triton
    import triton.language as tl

# Set by tests to run these kernels on CPU tensors under triton's interpreter
# (TRITON_INTERPRET=1), where nothing else would take them.
ON_CPU_FOR_TESTS = False
# FOLIO_FUSED_KERNELS=0: the torch layers on CUDA too (a device run's A/B)
_ENABLED = os.environ.get("FOLIO_FUSED_KERNELS", "1") != "0"


def serves(x: torch.Tensor) -> bool:
    """Whether the fused kernels run on this tensor: floating CUDA tensors
    where triton is installed."""
    # CUDA first: on the CPU's per-layer path this is one attribute read
    on_device = x.is_cuda or (ON_CPU_FOR_TESTS and x.device.type == "cpu")
    return on_device and _AVAILABLE and _ENABLED and x.is_floating_point()


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


if _AVAILABLE:
    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride,
                            res_stride, out_stride, res_out_stride, eps, N: tl.constexpr,
                            N_PAD: tl.constexpr, HAS_RES: tl.constexpr):
        t = tl.program_id(0)
        i = tl.arange(0, N_PAD)
        m = i < N
        x = tl.load(x_ptr + t * x_stride + i, mask=m, other=0.0)
        if HAS_RES:
            # x + residual in the run dtype (fp32 sum, rounded once), as torch adds
            x = (x.to(tl.float32) + tl.load(res_ptr + t * res_stride + i, mask=m,
                                            other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + t * res_out_stride + i, x, mask=m)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / N
        normed = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(w_ptr + i, mask=m, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + t * out_stride + i, y, mask=m)

    @triton.jit
    def _gated_act_kernel(gu_ptr, out_ptr, gu_stride, out_stride, N: tl.constexpr,
                          BLOCK: tl.constexpr, GELU: tl.constexpr):
        t = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        gate = tl.load(gu_ptr + t * gu_stride + i, mask=m, other=0.0)
        up = tl.load(gu_ptr + t * gu_stride + N + i, mask=m, other=0.0)
        g = gate.to(tl.float32)
        if GELU:        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        else:           # g sigmoid(g)
            act = g / (1.0 + tl.exp(-g))
        # torch rounds the activation to the run dtype before the product
        y = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + t * out_stride + i, y.to(gate.dtype), mask=m)

    @triton.jit
    def _rotary_store_kernel(qkv_ptr, cos_ptr, sin_ptr, k_cache, v_cache, slot_ptr,
                             qkv_stride, cs_stride, H: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, HALF_PAD: tl.constexpr, D_PAD: tl.constexpr,
                             STORE: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)                  # q heads, then k heads
        i = tl.arange(0, HALF_PAD)
        m = i < D // 2
        c = tl.load(cos_ptr + t * cs_stride + i, mask=m, other=0.0)
        s = tl.load(sin_ptr + t * cs_stride + i, mask=m, other=0.0)
        base = qkv_ptr + t * qkv_stride + head * D
        a = tl.load(base + i, mask=m, other=0.0)
        b = tl.load(base + D // 2 + i, mask=m, other=0.0)
        x1, x2 = a.to(tl.float32), b.to(tl.float32)
        r1 = (x1 * c - x2 * s).to(a.dtype)
        r2 = (x2 * c + x1 * s).to(a.dtype)
        if head < H:                              # a query head: rotated in place
            tl.store(base + i, r1, mask=m)
            tl.store(base + D // 2 + i, r2, mask=m)
        elif STORE:                               # a key head, and its value head
            kvh = head - H
            slot = tl.load(slot_ptr + t).to(tl.int64)
            row = (slot * HKV + kvh) * D
            ok = m & (slot >= 0)
            tl.store(k_cache + row + i, r1.to(k_cache.dtype.element_ty), mask=ok)
            tl.store(k_cache + row + D // 2 + i, r2.to(k_cache.dtype.element_ty), mask=ok)
            d = tl.arange(0, D_PAD)
            v = tl.load(qkv_ptr + t * qkv_stride + (H + HKV + kvh) * D + d, mask=d < D)
            tl.store(v_cache + row + d, v.to(v_cache.dtype.element_ty),
                     mask=(d < D) & (slot >= 0))
        else:                                     # a key head, rotated in place
            tl.store(base + i, r1, mask=m)
            tl.store(base + D // 2 + i, r2, mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (RMSNorm(x + residual) * weight, x + residual);
    without a residual, (RMSNorm(x) * weight, x)."""
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if T:
        res = residual if residual is not None else x
        _add_rmsnorm_kernel[(T,)](x, res, weight, out, res_out, x.stride(0), res.stride(0),
                                  out.stride(0), res_out.stride(0), float(eps), N=N,
                                  N_PAD=_pow2(N), HAS_RES=residual is not None)
    return out, res_out


def gated_act(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up [T, 2 N] (gate then up) -> act(gate) * up [T, N]; act SiLU, or
    GELU's tanh approximation where `gelu`."""
    T, N = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(_pow2(N), 1024)
        _gated_act_kernel[(T, triton.cdiv(N, block))](gate_up, out, gate_up.stride(0),
                                                      out.stride(0), N=N, BLOCK=block,
                                                      GELU=gelu)
    return out


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None) -> None:
    """qkv [T, (H + 2 Hkv) * D] (rows of contiguous heads), cos and sin [T, 1,
    D / 2] (fp32): q rotated in place; with caches ([blocks, block size, Hkv,
    D], a float dtype) the rotated k and the v of token t written at
    slot_mapping[t], else k rotated in place too."""
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
    store = k_cache is not None
    if T:
        dummy = qkv
        _rotary_store_kernel[(T, num_heads + num_kv_heads)](
            qkv, cos, sin, k_cache if store else dummy, v_cache if store else dummy,
            slot_mapping if store else dummy, qkv.stride(0), cos.stride(0), H=num_heads,
            HKV=num_kv_heads, D=head_dim, HALF_PAD=_pow2(head_dim // 2),
            D_PAD=_pow2(head_dim), STORE=store)
