"""Gated activations."""

import torch
import torch.nn.functional as F

from folio.kernels import native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> [..., d]."""
    if native.fuses(gate_up) and gate_up.dim() == 2:
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
