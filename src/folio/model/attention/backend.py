"""The attention backend interface and the KV cache layout it reads and writes.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values).
"""

from __future__ import annotations

import torch

from folio.model.attention.metadata import AttentionMetadata


class AttentionBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the step's tokens -> [T, H, D]."""
        raise NotImplementedError


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def get_attention_backend(device: str) -> type[AttentionBackend]:
    from folio.model.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend
