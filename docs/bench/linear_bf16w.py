"""The AVX2 bf16-weight linear kernel against torch's fp32 F.linear, at the
default model's layer shapes and decode-to-prefill row counts, side by side in
one process (best of 5 timed loops each).

    .venv/bin/python docs/bench/linear_bf16w.py
"""

import platform
import time

import torch
import torch.nn.functional as F

from folio.env_report import cpu_info
from folio.kernels import native

SHAPES = [(960, 576, "qkv"), (576, 576, "o"), (3072, 576, "gate_up"), (576, 1536, "down"),
          (49152, 576, "LM head")]


def best_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(2)
    model, flags = cpu_info()
    print(f"{model}; avx2={'avx2' in flags} avx512f={'avx512f' in flags}; torch "
          f"{torch.__version__}; python {platform.python_version()}; 2 threads")
    print("| layer | N x K | rows | fp32 F.linear (us) | bf16 weights (us) | speedup |")
    print("|---|---|---|---|---|---|")
    for n, k, name in SHAPES:
        w = torch.randn(n, k)
        packed = native.pack_linear_bf16w(w)
        for m in (1, 4, 8, 32):
            x = torch.randn(m, k)
            reps = 20 if n > 10000 else 200
            a = best_us(lambda: F.linear(x, w), reps)
            b = best_us(lambda: native.linear_bf16w(x, packed, n), reps)
            print(f"| {name} | {n} x {k} | {m} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
