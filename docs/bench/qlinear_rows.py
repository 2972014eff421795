"""The native quantized linear kernel with fp32 activations at decode-to-prefill
row counts: GGUF Q4_1-shaped weights (4-bit codes, groups of 32, offsets) at
the default model's MLP shapes, 2 threads, microseconds per call (best of 5
timed loops), one line for the checkout it runs from. To compare two commits,
run it from each (a `git worktree` of the other first on PYTHONPATH), in turn:

    .venv/bin/python docs/bench/qlinear_rows.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/bench/qlinear_rows.py --avx2-sim
"""

import argparse
import sys
from pathlib import Path

ROWS = (4, 6, 8, 16, 32, 128, 512)
SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--avx2-sim", action="store_true",
                   help="as an AVX2-only CPU would run it (scripts/avx2_sim.py)")
    args = p.parse_args()
    if args.avx2_sim:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
        import avx2_sim
        avx2_sim.apply()
    import torch
    from linear_bf16w import best_us       # docs/bench/, beside this script

    from folio.model import native
    from folio.model.layers.quantization.int_groups import IntGroups
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    cells = []
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), generator=g)
        scale = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
        offset = -torch.rand(n, k // 32, generator=g) * 0.05
        w = IntGroups.from_codes(codes, torch.arange(k) // 32, scale, 4, offset=offset)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            reps = max(2, int(2000 / (m * n * k / 1e6 + 1)))
            cells.append(f"{name}/{m}:{best_us(lambda: native.qlinear(x, w), reps):.0f}")
    print(" ".join(cells))


if __name__ == "__main__":
    main()
