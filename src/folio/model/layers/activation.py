"""Gated activations."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
