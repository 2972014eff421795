"""The fp8 weight kernel (native/fp8linear.c) beside qlinear.c's 8-bit
integer codes on one matrix of the same shape (issue 54): ms a call at one
row and at 32, 50 calls each after a warm-up; int8 codes with int8
activations (integer dot products, the default on quantized codes) and with
fp32 ones (the float path, the arithmetic a weight-only fp8 product does).

    .venv/bin/python docs/bench/fp8_kernel.py [--n 8192] [--k 2048]
"""

from __future__ import annotations

import argparse
import time

import torch

from folio.kernels import native
from folio.model.layers.quantization import fp8
from folio.model.layers.quantization.int_groups import IntGroups


def per_call(f, reps: int = 50) -> float:
    f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    args = p.parse_args()
    n, k = args.n, args.k
    torch.manual_seed(0)
    codes, scales = fp8.quantize(torch.randn(n, k))
    c, s = native.pack_fp8_linear(codes, scales, k)
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    ints = IntGroups.from_codes(q, torch.zeros(k, dtype=torch.long), torch.full((n, 1), 0.01), 8,
                                zero=torch.full((n, 1), 128.0))
    print(f"[{n}, {k}] weights, {torch.get_num_threads()} threads")
    print("| rows | fp8 ms | int8 codes, int8 activations ms | int8 codes, fp32 activations ms |")
    print("|---:|---:|---:|---:|")
    for m in (1, 32):
        x = torch.randn(m, k)
        f = per_call(lambda: native.fp8_linear(x, c, s, k, n))
        i8 = per_call(lambda: native.qlinear(x, ints, None,
                                             quantize_x=native.QLINEAR_INT8_AT_FEW_ROWS))
        f32 = per_call(lambda: native.qlinear(x, ints, None, quantize_x=0))
        print(f"| {m} | {f * 1e3:.2f} | {i8 * 1e3:.2f} | {f32 * 1e3:.2f} |")


if __name__ == "__main__":
    main()
