"""The 8-bit KV caches (`--kv-cache-dtype int8|fp8`, issue 32): each key or
value row of one token and one head is stored as its head_dim values in 8
bits and, right after them, the row's scale as the 4 bytes of an fp32:

    [2, num_blocks, block_size, num_kv_heads, head_dim + 4]   int8 | uint8

- int8 (storage int8): value = step * scale, scale = max |row| / 127, steps
  round(x * ((1 / max) * 127)), ties to even (the native decoder's writes,
  native/decoder.c, round the same way bit for bit);
- fp8 (e4m3, storage uint8: the bytes of torch.float8_e4m3fn): value =
  e4m3 * scale, scale = max |row| / 448 (e4m3's largest), the row times
  (1 / max) * 448 rounded to e4m3 by torch (nearest even);
- fp8_e5m2 (storage torch.float8_e5m2, vLLM's other fp8 cache): value =
  e5m2 * scale, scale = max |row| / 57344 (e5m2's largest), rounded by
  torch; an e5m2 is the top byte of a float16, so it widens exactly.

Both scales are computed when the token is written, unless a checkpoint
gives an fp8 cache static ones (compressed-tensors' kv_cache_scheme: one
k_scale and v_scale a layer), which every row then carries: values are the
row times 1 / that scale, rounded to e4m3 (448 at most). Keeping the scale in the
row keeps everything that handles a block as it is: a block's bytes count
the scales, copy-on-write and the prefix cache copy and share them with the
values, and a cache is still one tensor per layer, its storage dtype saying
which kind it holds. head_dim is a multiple of 4, so each scale is 4-byte
aligned.
"""

from __future__ import annotations

from typing import Optional

import torch

SCALE_BYTES = 4
QUANTIZED = ("int8", "fp8", "fp8_e5m2")     # cache dtypes stored this way
# the largest step of each kind, and its storage
_LARGEST = {"int8": 127.0, "fp8": 448.0, "fp8_e5m2": 57344.0}
_STORAGE = {"int8": torch.int8, "fp8": torch.uint8, "fp8_e5m2": torch.float8_e5m2}
_KIND = {torch.int8: "int8", torch.uint8: "fp8", torch.float8_e5m2: "fp8_e5m2"}


def row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements of the cache's last dimension for one token and head."""
    if kv_dtype not in QUANTIZED:
        return head_dim
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an {kv_dtype} KV cache needs a head_dim that is a multiple of "
                         f"{SCALE_BYTES} (its scales stay aligned); this model's is {head_dim}")
    return head_dim + SCALE_BYTES


def storage_dtype(kv_dtype: str) -> torch.dtype:
    return _STORAGE.get(kv_dtype) or getattr(torch, kv_dtype)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _KIND


def quantize(x: torch.Tensor, kind: str = "int8", static: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """x [..., D] float -> [..., D + 4]: the rows in 8-bit steps of their own
    scale (or of `static`, a checkpoint's: one fp32 scale per KV head, x being
    [..., Hkv, D]), each followed by that scale."""
    xf = x.float()
    largest = _LARGEST[kind]
    if static is not None:
        scale = static.to(device=x.device, dtype=torch.float32).view(-1, 1).expand(
            *x.shape[:-1], 1).contiguous()
        scaled = xf * (1.0 / scale)
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = amax * (1.0 / largest)
        scaled = xf * torch.where(amax > 0, (1.0 / amax) * largest, 0.0)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=_STORAGE[kind],
                      device=x.device)
    raw = out.view(torch.uint8) if kind == "fp8_e5m2" else out
    if kind == "int8":
        raw[..., :x.shape[-1]] = scaled.round().clamp(-127, 127).to(torch.int8)
    elif kind == "fp8":
        raw[..., :x.shape[-1]] = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(
            torch.uint8)
    else:
        raw[..., :x.shape[-1]] = scaled.clamp(-largest, largest).to(torch.float8_e5m2).view(
            torch.uint8)
    raw[..., x.shape[-1]:] = scale.view(raw.dtype)
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] 8-bit rows -> [..., 1] fp32: each row's scale."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] 8-bit rows -> [..., D] in `dtype`."""
    steps = rows[..., :-SCALE_BYTES]
    if rows.dtype == torch.uint8:
        steps = steps.contiguous().view(torch.float8_e4m3fn)
    return (steps.float() * scales(rows)).to(dtype)


def read(cache_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a cache (any leading shape) as `dtype` values: dequantized from
    an 8-bit cache, widened from a narrower float one."""
    return dequantize(cache_part, dtype) if is_quantized(cache_part) else cache_part.to(dtype)


def stored(x: torch.Tensor, cache_dtype: torch.dtype, static: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """Rows [..., Hkv, D] as a cache of `cache_dtype` stores them; `static`: a
    checkpoint's scales [Hkv], which an fp8 cache takes (None: each row's own)."""
    kind = _KIND.get(cache_dtype)
    if not kind:
        return x.to(cache_dtype)
    return quantize(x, kind, static if kind == "fp8" else None)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype,
              static: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x as the cache would give it back (rounded to its dtype or its 8-bit
    steps), in `dtype`: what a whole prompt's own keys are attended as."""
    return read(stored(x, cache_dtype, static), dtype)
