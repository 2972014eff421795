"""Threads and placement at decode sizes (issue 14): each kernel the engine runs
at 1 and 2 threads, and at 2 threads pinned one to a core (OpenMP's
OMP_PROC_BIND=close, OMP_PLACES=cores) against unpinned, side by side.

The pinning is set before the OpenMP runtime starts, so each configuration runs
in its own process (this script re-runs itself); the figures are the best of
5 timed loops, in microseconds per call.

    .venv/bin/python docs/bench/threads.py
"""

import json
import os
import subprocess
import sys

from linear_bf16w import best_us       # docs/bench/, beside this script

CONFIGS = {
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads": {"OMP_NUM_THREADS": "2"},
    "2 threads, pinned": {"OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close",
                          "OMP_PLACES": "cores"},
}


def measure() -> dict:
    import torch
    import torch.nn.functional as F

    from folio.kernels import native
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = {}
    g = torch.Generator().manual_seed(0)
    for rows in (1, 8, 32):
        for n, k, name in ((3072, 576, "gate_up"), (576, 1536, "down")):
            w = torch.randn(n, k, generator=g)
            x = torch.randn(rows, k, generator=g)
            out[f"fp32 F.linear {name}, {rows} rows"] = best_us(lambda: F.linear(x, w), 100)
            if native.packs_linear_bf16w(w):
                p = native.pack_linear_bf16w(w)
                out[f"AVX2 bf16-weight {name}, {rows} rows"] = best_us(
                    lambda: native.linear_bf16w(x, p, n), 100)
            wb, xb = w.bfloat16(), x.bfloat16()
            if native.packs_linear(wb):
                p = native.pack_linear(wb)
                out[f"AVX512-BF16 {name}, {rows} rows"] = best_us(
                    lambda: native.linear(xb, p, n), 100)
    # paged attention: 32 decode rows with 256 keys each, the default model's heads
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    blocks = 32 * 16
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(2, blocks, bs, kv_heads, dim, generator=g).to(dtype)
        q = torch.randn(32, heads, dim, generator=g).to(dtype)
        tables = torch.arange(blocks).view(32, 16)
        rows, lens = torch.arange(32), torch.full((32,), 256)
        if native.supports(q):
            out[f"paged attention {str(dtype)[6:]}, 32 x 256 keys"] = best_us(
                lambda: native.paged_attention(q, kv, tables, rows, lens, dim ** -0.5), 100)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure()))
        return
    results = {}
    for name, env in CONFIGS.items():
        done = subprocess.run([sys.executable, __file__, "--child"], capture_output=True,
                              text=True, check=True, env=dict(os.environ, **env))
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    names = list(CONFIGS)
    print("| kernel | " + " | ".join(f"{n} (us)" for n in names) + " | 2 threads over 1 | "
          "pinned over unpinned |")
    print("|---|" + "---|" * (len(names) + 2))
    for kernel in results[names[0]]:
        one, two, pinned = (results[n][kernel] for n in names)
        print(f"| {kernel} | {one:.0f} | {two:.0f} | {pinned:.0f} | {one / two:.2f}x | "
              f"{two / pinned:.2f}x |")


if __name__ == "__main__":
    main()
