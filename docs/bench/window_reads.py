"""A sliding-window layer's decode in the portable TORCH_SDPA backend (issue
29): reading only the blocks its window touches against reading the whole
context and masking (the backend before), in one run. 8 sequences, 8 query
heads over 2 KV heads of 128, blocks of 16, window 512 (Gemma 3 1B's is
512, its larger ones 1024), fp32 and bf16, contexts 1K-16K.

    .venv/bin/python docs/bench/window_reads.py
"""

import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch

from folio.model.attention.metadata import AttentionMetadata
from folio.model.attention.torch_backend import TorchAttentionBackend


class WholeContext(TorchAttentionBackend):
    def _window_blocks(self, tables, ends, block_size):
        return tables, torch.zeros_like(ends)


def step_ms(backend, q, cache, meta) -> float:
    for _ in range(3):
        backend.attend(q, None, None, cache, meta)
    times = []
    for _ in range(15):
        t = time.perf_counter()
        backend.attend(q, None, None, cache, meta)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    heads, kv_heads, dim, bs, window, b = 8, 2, 128, 16, 512, 8
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for ctx in (1024, 4096, 16384):
            width = ctx // bs
            cache = torch.randn(2, b * width + 1, bs, kv_heads, dim).to(dtype)
            tables = torch.arange(1, b * width + 1).view(b, width)
            meta = AttentionMetadata(slot_mapping=None, num_decodes=b,
                                     decode_block_tables=tables,
                                     decode_context_lens=torch.full((b,), ctx))
            q = torch.randn(b, heads, dim).to(dtype)
            args = (heads, kv_heads, dim, dim ** -0.5)
            window_ms = step_ms(TorchAttentionBackend(*args, sliding_window=window), q, cache,
                                meta)
            whole_ms = step_ms(WholeContext(*args, sliding_window=window), q, cache, meta)
            row = {"dtype": str(dtype).split(".")[1], "context": ctx,
                   "window_ms": round(window_ms, 2), "whole_context_ms": round(whole_ms, 2),
                   "speedup": round(whole_ms / window_ms, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith("avx")})
    print(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                      "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "cpu_flags": flags}))


if __name__ == "__main__":
    main()
