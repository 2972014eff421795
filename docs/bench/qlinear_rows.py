"""The native quantized linear kernel with fp32 activations at decode-to-prefill
row counts: GGUF Q4_1-shaped weights (4-bit codes, groups of 32, offsets; with
--bits 8, Q8_0-shaped) at the default model's MLP shapes, 2 threads,
microseconds per call (best of 5 timed loops, the ~27 us of the Python call
included), one line for the checkout it runs from; with --modes, one line per
quantize_x mode (0 float, 1 int16, 2 int8): where int8 stops winning is
folio_qlinear_int8_rows. To compare two commits,
run it from each (a `git worktree` of the other first on PYTHONPATH), in turn.
With --interleave the modes alternate call by call and each keeps its best
single call: on a machine whose speed drifts from second to second (a shared
VM), one mode timed after the other measures the drift as much as the modes.

    .venv/bin/python docs/bench/qlinear_rows.py
    .venv/bin/python docs/bench/qlinear_rows.py --modes 0,2 --interleave [--bits 8]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/bench/qlinear_rows.py --avx2-sim
"""

import argparse
import sys
import time
from pathlib import Path

ROWS = (1, 4, 6, 8, 16, 32, 48, 64, 128, 256, 512)
SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--avx2-sim", action="store_true",
                   help="as an AVX2-only CPU would run it (scripts/avx2_sim.py)")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4)
    p.add_argument("--modes", default="", metavar="0,1,2",
                   help="quantize_x modes to time, one line each (default: the kernel's default)")
    p.add_argument("--interleave", action="store_true",
                   help="alternate the modes call by call (best single call of each)")
    args = p.parse_args()
    if args.avx2_sim:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
        import avx2_sim
        avx2_sim.apply()
    import torch
    from linear_bf16w import best_us       # docs/bench/, beside this script

    from folio.kernels import native
    from folio.model.layers.quantization.int_groups import IntGroups
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    modes = [int(m) for m in args.modes.split(",")] if args.modes else [None]
    lines = {mode: [] for mode in modes}
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 1 << args.bits, (n, k), generator=g)
        scale = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
        offset = -torch.rand(n, k // 32, generator=g) * 0.05
        w = IntGroups.from_codes(codes, torch.arange(k) // 32, scale, args.bits, offset=offset)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            reps = max(2, int(2000 / (m * n * k / 1e6 + 1)))
            calls = {mode: (lambda kw={} if mode is None else {"quantize_x": mode}:
                            native.qlinear(x, w, **kw)) for mode in modes}
            if args.interleave:
                best = dict.fromkeys(modes, float("inf"))
                for _ in range(max(5, 5 * reps)):
                    for mode, call in calls.items():
                        start = time.perf_counter()
                        call()
                        best[mode] = min(best[mode], time.perf_counter() - start)
                times = {mode: t * 1e6 for mode, t in best.items()}
            else:
                times = {mode: best_us(call, reps) for mode, call in calls.items()}
            for mode, us in times.items():
                lines[mode].append(f"{name}/{m}:{us:.0f}")
    for mode, cells in lines.items():
        print(("" if mode is None else f"mode {mode}: ") + " ".join(cells))


if __name__ == "__main__":
    main()
