"""Rotary position embedding (rotate-half layout), with Llama-3 and linear scaling.

cos/sin are tabulated once for every position up to max_positions, in fp32, and
the rotation itself is applied in fp32 then cast back.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from folio.kernels import native


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama-3 scaling: long wavelengths slowed by `factor`, short ones kept, and a
    smooth blend between the two bands."""
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    original = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    in_between = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_between, smoothed, scaled)


def inv_frequencies(dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    inv_freq = _base_inv_freq(dim, theta)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables; `forward(positions)` gathers the step's rows once, and
    every layer then rotates its q and k with `apply_rotary`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]          # [max_positions, head_dim/2]
        # Rotate-half pairs dimension i with i + head_dim/2 and both use freq i,
        # so one half-width table serves both halves.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim/2] (fp32)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads together) -> rotated, in fp32, cast back.
    bf16 on the CPU is rotated in place by the native kernel."""
    if native.fuses(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return native.rotary_(x, cos, sin)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
