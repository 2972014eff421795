"""The quantized kernel (native/qlinear.c) on each held form of one weight:
4-, 6- and 8-bit codes, with float16 scales and offsets a group ("flat") or
a GGUF K-quant's two-level ones (an int8 a group under a float16 pair a
super-block of 256 inputs, "two"), int8 activations (the engine's mode on
VNNI CPUs), at 1, 4 and 32 rows. Random codes and scales; the time of one
call, the best of --repeats loops, in microseconds, and the bytes held.

    .venv/bin/python docs/bench/qlinear_forms.py [--n 5632] [--k 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from folio.kernels import native
from folio.model.layers.quantization.int_groups import IntGroups

FORMS = ((4, 32), (6, 16), (8, 16))      # (bits, group): Q4_K's, Q6_K's, 8-bit codes
ROWS = (1, 4, 32)


def weights(n: int, k: int, bits: int, group: int, two_level: bool, g) -> IntGroups:
    per, count = 256 // group, k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    d, e = ((torch.rand(n, count // per, generator=g) * 0.01 + 0.001).half().float()
            .repeat_interleave(per, 1) for _ in range(2))
    sc, om = (torch.randint(1, 64, (n, count), generator=g).float() for _ in range(2))
    return IntGroups.from_codes(codes, torch.arange(k) // group, sc * d, bits, offset=om * e,
                                supers=(d, e, per) if two_level else None)


def per_call(w: IntGroups, rows: int, repeats: int) -> float:
    x = torch.randn(rows, w.in_features)
    calls = 200 if rows == 1 else 50
    for _ in range(3):
        native.qlinear(x, w, quantize_x=2)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            native.qlinear(x, w, quantize_x=2)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5632)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not native.runs_qlinear(torch.zeros(1)):
        raise SystemExit("no quantized kernel on this machine")
    g = torch.Generator().manual_seed(0)
    print(f"{args.n} x {args.k}, {torch.get_num_threads()} threads")
    print("| bits | group | scales | KiB held | " + " | ".join(f"{m} rows, us" for m in ROWS) + " |")
    print("|---|---|---|---|" + "---|" * len(ROWS))
    for bits, group in FORMS:
        for two_level in (False, True):
            w = weights(args.n, args.k, bits, group, two_level, g)
            times = " | ".join(f"{per_call(w, m, args.repeats):.0f}" for m in ROWS)
            print(f"| {bits} | {group} | {'two' if two_level else 'flat'} | "
                  f"{w.nbytes // 1024} | {times} |")


if __name__ == "__main__":
    main()
