"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import math
from typing import Optional

import torch

from folio.config import FolioConfig, ModelConfig
from folio.model.attention import kv_quant
from folio.model.attention.backend import AttentionBackend

CPU_DEFAULT_KV_BYTES = 2 * 1024**3      # leaves room on a 24 GiB machine
# (CUDA without a size given: worker/gpu_memory.py, by --gpu-memory-utilization)


def _shape(config: FolioConfig, num_blocks: int, num_kv_heads: int,
           backend: type[AttentionBackend], model: ModelConfig) -> tuple[int, ...]:
    """One layer's cache, in the layout of the backend that reads it (an
    8-bit cache's rows hold their scales too: kv_quant.py)."""
    return backend.get_kv_cache_shape(num_blocks, config.cache.block_size, num_kv_heads,
                                      kv_quant.row_width(model.head_dim, config.kv_dtype))


def bytes_per_block(config: FolioConfig, num_kv_heads: int,
                    backend: type[AttentionBackend],
                    model: Optional[ModelConfig] = None) -> int:
    """A block's bytes over every layer of `model` (default: the served one;
    a draft model's cache has blocks of the same ids beside it)."""
    model = model or config.model
    elem = torch.empty((), dtype=kv_quant.storage_dtype(config.kv_dtype)).element_size()
    return model.num_hidden_layers * math.prod(
        _shape(config, 1, num_kv_heads, backend, model)) * elem


def capacity(config: FolioConfig, num_kv_heads: int, backend: type[AttentionBackend],
             kv_dtype: str, budget: int) -> dict:
    """What `budget` bytes of cache hold with `kv_dtype` elements: blocks,
    tokens and requests of max_model_len at once (an 8-bit row counts its
    scale)."""
    import dataclasses
    cfg = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                kv_cache_dtype=kv_dtype))
    per_block = bytes_per_block(cfg, num_kv_heads, backend)
    blocks = budget // per_block
    tokens = blocks * config.cache.block_size
    return {"kv_cache_dtype": kv_dtype, "bytes_per_block": per_block, "blocks": blocks,
            "tokens": tokens, "requests_at_max_model_len": tokens // config.max_model_len}


def kv_memory_budget(config: FolioConfig) -> int:
    if config.cache.kv_cache_memory_bytes is not None:
        return config.cache.kv_cache_memory_bytes
    return CPU_DEFAULT_KV_BYTES


def num_kv_blocks(config: FolioConfig, num_kv_heads: int,
                  backend: type[AttentionBackend], extra_bytes_per_block: int = 0) -> int:
    """Blocks in the budget; `extra_bytes_per_block`: a draft model's share
    of each block (its own cache, indexed by the same block ids)."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    n = kv_memory_budget(config) // (bytes_per_block(config, num_kv_heads, backend)
                                     + extra_bytes_per_block)
    if n < 1:
        raise ValueError("kv_cache_memory_bytes is too small to hold a single KV block")
    return n


def allocate_kv_caches(config: FolioConfig, num_blocks: int, num_kv_heads: int,
                       backend: type[AttentionBackend],
                       model: Optional[ModelConfig] = None) -> list[torch.Tensor]:
    """One tensor per layer in the backend's layout, allocated once."""
    model = model or config.model
    shape = _shape(config, num_blocks, num_kv_heads, backend, model)
    dtype = kv_quant.storage_dtype(config.kv_dtype)
    return [torch.zeros(shape, dtype=dtype, device=config.device)
            for _ in range(model.num_hidden_layers)]
