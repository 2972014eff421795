"""RMSNorm, computed in fp32 whatever the run dtype, with the residual add fused in.

`forward(x, residual)` returns (norm(x + residual), x + residual): the decoder
carries the residual stream beside the hidden states, so every add joins the
norm that follows it (one native kernel for bf16 on the CPU, one Triton kernel
on CUDA).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.kernels import native, triton_elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if native.fuses(x) and x.dim() == 2:
            return native.add_rmsnorm(x, residual, self.weight, self.eps)
        if triton_elementwise.serves(x) and x.dim() == 2:
            return triton_elementwise.add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # The scale is applied after the cast back, in the run dtype, as the
        # reference implementation does (bit-exact parity in fp32).
        return self.weight * h.to(dtype)
