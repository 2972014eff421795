"""Gated activations."""

import torch
import torch.nn.functional as F

from folio.kernels import native, triton_elementwise


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> [..., d]."""
    if native.fuses(gate_up) and gate_up.dim() == 2:
        return native.silu_mul(gate_up)
    if triton_elementwise.serves(gate_up) and gate_up.dim() == 2:
        return triton_elementwise.gated_act(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
