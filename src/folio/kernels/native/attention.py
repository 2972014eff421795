"""The paged attention kernel's wrapper (`paged_attention.c`), and the codes
of the KV cache dtypes it reads."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from folio.kernels.native import _DTYPE_CODES, load

# the KV cache's: float32, bfloat16, and the 8-bit caches' rows with their
# scales (attention/kv_quant.py): int8, fp8 e4m3 stored as uint8, fp8 e5m2
_KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3,
             torch.float8_e5m2: 4}
EIGHT_BIT = (torch.int8, torch.uint8, torch.float8_e5m2)


def kv_code(dtype: torch.dtype) -> int:
    """The kernels' code for a KV cache's dtype (2 int8, 3 fp8 e4m3, 4 fp8 e5m2:
    rows with their scales)."""
    return _KV_CODES[dtype]


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_rows: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    lib: Optional[ctypes.CDLL] = None,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
    """Attention of every query token of a step: q [T, H, D] (rows may be
    strided, heads and D dense), kv_cache [2, NB, BS, Hkv, D] in q's dtype or
    (fp32 q) in bfloat16, --kv-cache-dtype's, or int8 [.., D + 4] rows with
    their scales; token t reads
    block_tables[token_rows[t]] up to context_lens[t] keys, the last
    `sliding_window` of them only where that is given. -> [T, H, D]."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.dtype in EIGHT_BIT:
        head_dim -= 4                       # each 8-bit row's scale
    tables = block_tables.contiguous()
    lib = lib or load()
    args = (q.data_ptr(), q.stride(0), kv_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
            tables.shape[1], token_rows.contiguous().data_ptr(),
            context_lens.contiguous().data_ptr(), tokens, heads, num_kv_heads, head_dim,
            block_size, num_blocks, scale, _DTYPE_CODES[q.dtype], kv_code(kv_cache.dtype),
            torch.get_num_threads())
    if sliding_window is None:
        failed = lib.folio_paged_attention(*args)
    else:
        failed = lib.folio_paged_attention_window(*args, sliding_window)
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out
