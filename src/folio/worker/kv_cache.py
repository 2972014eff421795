"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import torch

from folio.config import FolioConfig
from folio.model.attention.backend import kv_cache_shape

CPU_DEFAULT_KV_BYTES = 2 * 1024**3      # leaves room on a 24 GiB machine
CUDA_DEFAULT_FRACTION = 0.5             # of the memory free after loading the model


def bytes_per_block(config: FolioConfig, num_kv_heads: int) -> int:
    m = config.model
    elem = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    return 2 * m.num_hidden_layers * config.cache.block_size * num_kv_heads * m.head_dim * elem


def kv_memory_budget(config: FolioConfig) -> int:
    if config.cache.kv_cache_memory_bytes is not None:
        return config.cache.kv_cache_memory_bytes
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return int(free * CUDA_DEFAULT_FRACTION)
    return CPU_DEFAULT_KV_BYTES


def num_kv_blocks(config: FolioConfig, num_kv_heads: int) -> int:
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    n = kv_memory_budget(config) // bytes_per_block(config, num_kv_heads)
    if n < 1:
        raise ValueError("kv_cache_memory_bytes is too small to hold a single KV block")
    return n


def allocate_kv_caches(config: FolioConfig, num_blocks: int, num_kv_heads: int) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, Hkv, D] tensor per layer, allocated once."""
    m = config.model
    shape = kv_cache_shape(num_blocks, config.cache.block_size, num_kv_heads, m.head_dim)
    dtype = getattr(torch, config.dtype)
    return [torch.zeros(shape, dtype=dtype, device=config.device)
            for _ in range(m.num_hidden_layers)]
