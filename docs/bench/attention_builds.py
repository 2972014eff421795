"""The native paged-attention kernel in each build this CPU runs, side by side
in one process: the portable C build (-mno-avx512f -mno-avx2: what an AVX2-only
CPU ran before the AVX2 tiles), the AVX2 one (-mno-avx512f -mno-avxvnni: what
it runs now) and, where the CPU has AVX-512, this machine's own. The default
model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16),
one layer, 2 threads, microseconds per call (best of 5 timed loops), the builds
alternated round by round.

    .venv/bin/python docs/bench/attention_builds.py [--rounds N]
"""

import argparse
import platform

import torch
from linear_bf16w import best_us       # docs/bench/, beside this script

from folio.env_report import cpu_info
from folio.kernels import native

HEADS, KV_HEADS, BLOCK, DIM = 9, 3, 16, 64
BUILDS = [("portable C", ("-mno-avx512f", "-mno-avx2")),
          ("AVX2 tiles", ("-mno-avx512f", "-mno-avxvnni")),
          ("AVX-512 tiles (native)", ())]


def cases():
    """(name, token rows, context lengths, sequences): 32 decodes at 256 keys,
    one 384-token prompt, and 4 chunks of 128 tokens resuming at position 256."""
    yield "decode, 32 x 256 keys", torch.arange(32), torch.full((32,), 256), 32
    yield "prefill, 384 tokens", torch.zeros(384, dtype=torch.long), torch.arange(1, 385), 1
    yield ("prefill, 4 chunks of 128 at 256", torch.arange(4).repeat_interleave(128),
           torch.cat([torch.arange(257, 385)] * 4), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(2)
    model, flags = cpu_info()
    print(f"{model}; avx2={'avx2' in flags} fma={'fma' in flags} avx512f={'avx512f' in flags}"
          f"; torch {torch.__version__}; python {platform.python_version()}; 2 threads")
    builds = [(name, native._build(extra)) for name, extra in BUILDS
              if extra or "avx512f" in flags]
    names = [name for name, _ in builds]
    print("| dtype | case | round | " + " | ".join(f"{n} (us)" for n in names)
          + " | AVX2 over portable |")
    print("|---" * (len(names) + 4) + "|")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for case, rows, lens, seqs in cases():
            width = -(-int(lens.max()) // BLOCK)
            blocks = seqs * width + 1
            kv = torch.randn(2, blocks, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
            tables = torch.randperm(blocks, generator=g)[:seqs * width].view(seqs, width)
            q = torch.randn(len(lens), HEADS, DIM, generator=g).to(dtype)
            for r in range(args.rounds):
                us = [best_us(lambda: native.paged_attention(q, kv, tables, rows, lens,
                                                             DIM ** -0.5, lib), 10)
                      for _, lib in builds]
                print(f"| {str(dtype).removeprefix('torch.')} | {case} | {r + 1} | "
                      + " | ".join(f"{u:.0f}" for u in us) + f" | {us[0] / us[1]:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
