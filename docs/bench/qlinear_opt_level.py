"""Does qlinear.c need -O3? (issue 53: the fast suite.) Its -O3 compile is
~56 s of a native build's ~60 on 2 cores, -O2's ~9 s. This builds the kernel
library twice (this machine's flags, then with -O2 after the -O3) and times
the quantized linear kernel of both, call by call alternated (the best
single call of each), on the default model's MLP shapes and a 1B model's
(hidden 2048, MLP 8192): 4-bit codes (Q4_1's form) and 8-bit (Q8_0's), the
int8-activation mode (the default for a GGUF's codes) and fp32 activations,
at 1, 8 and 64 rows, 2 threads.

    .venv/bin/python docs/bench/qlinear_opt_level.py
"""

from __future__ import annotations

import time

import torch

from folio.kernels import native
from folio.model.layers.quantization.int_groups import IntGroups

SHAPES = {"135M gate_up": (3072, 576), "135M down": (576, 1536),
          "1B gate_up": (16384, 2048), "1B down": (2048, 8192)}
ROWS = (1, 8, 64)


def main() -> None:
    torch.set_num_threads(2)
    libs = {"-O3": native.load(), "-O2": native._build(("-O2",))}
    g = torch.Generator().manual_seed(0)
    print(f"CPU: {native._cpu_flags().split(':')[-1].strip()[:0] or ''}"
          f"{' '.join(f for f in ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'avx512_vnni', 'amx_tile') if f in native._cpu_flags().split())}")
    print("| shape | bits | activations | rows | -O3 us | -O2 us | O2 / O3 |")
    print("|---|---:|---|---:|---:|---:|---:|")
    ratios = []
    for name, (n, k) in SHAPES.items():
        for bits in (4, 8):
            codes = torch.randint(0, 1 << bits, (n, k), generator=g)
            scale = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
            offset = -torch.rand(n, k // 32, generator=g) * 0.05
            w = IntGroups.from_codes(codes, torch.arange(k) // 32, scale, bits, offset=offset)
            for mode, label in ((2, "int8"), (0, "fp32")):
                for m in ROWS:
                    x = torch.randn(m, k, generator=g)
                    best = dict.fromkeys(libs, float("inf"))
                    reps = max(5, int(300 / (m * n * k / 1e6 + 1)))
                    for _ in range(reps):
                        for key, lib in libs.items():
                            start = time.perf_counter()
                            native.qlinear(x, w, quantize_x=mode, lib=lib)
                            best[key] = min(best[key], time.perf_counter() - start)
                    r = best["-O2"] / best["-O3"]
                    ratios.append(r)
                    print(f"| {name} | {bits} | {label} | {m} | {best['-O3'] * 1e6:.0f} "
                          f"| {best['-O2'] * 1e6:.0f} | {r:.2f} |")
    ratios.sort()
    print(f"\nO2 / O3: median {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
