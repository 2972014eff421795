"""The 8-bit KV cache (`--kv-cache-dtype int8`, issue 32): each key or value
row of one token and one head is stored as its head_dim values in int8 and,
right after them, the row's scale as the 4 bytes of an fp32:

    [2, num_blocks, block_size, num_kv_heads, head_dim + 4]   int8

value = int8 * scale, scale = max |row| / 127, computed when the token is
written (as `max * (1/127)`, and the steps as round(x * ((1 / max) * 127)),
ties to even: the native decoder's writes, native/decoder.c, round the same
way bit for bit). Keeping the scale in the row keeps everything that handles a block
as it is: a block's bytes count the scales, copy-on-write and the prefix
cache copy and share them with the values, and a cache is still one tensor
per layer. head_dim is a multiple of 4, so each scale is 4-byte aligned.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
QUANTIZED = ("int8",)           # cache dtypes stored this way


def row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements of the cache's last dimension for one token and head."""
    if kv_dtype not in QUANTIZED:
        return head_dim
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an {kv_dtype} KV cache needs a head_dim that is a multiple of "
                         f"{SCALE_BYTES} (its scales stay aligned); this model's is {head_dim}")
    return head_dim + SCALE_BYTES


def storage_dtype(kv_dtype: str) -> torch.dtype:
    return torch.int8 if kv_dtype in QUANTIZED else getattr(torch, kv_dtype)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> [..., D + 4] int8: the rows rounded to the nearest
    step of their own scale, each followed by that scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax * (1.0 / 127.0)
    q = xf * torch.where(amax > 0, (1.0 / amax) * 127.0, 0.0)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8,
                      device=x.device)
    out[..., :x.shape[-1]] = q.round().clamp(-127, 127).to(torch.int8)
    out[..., x.shape[-1]:] = scale.view(torch.int8)
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., 1] fp32: each row's scale."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., D] in `dtype`."""
    return (rows[..., :-SCALE_BYTES].float() * scales(rows)).to(dtype)


def read(cache_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a cache (any leading shape) as `dtype` values: dequantized from
    an 8-bit cache, widened from a narrower float one."""
    return dequantize(cache_part, dtype) if is_quantized(cache_part) else cache_part.to(dtype)


def as_stored(x: torch.Tensor, kv_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache would give it back (rounded to its dtype or its 8-bit
    steps), in `dtype`: what a whole prompt's own keys are attended as."""
    if kv_dtype == torch.int8:
        return dequantize(quantize(x), dtype)
    return x.to(kv_dtype).to(dtype)
