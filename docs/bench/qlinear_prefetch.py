"""How far ahead the int8 path should ask for its codes (issue 53: one request
at the memory's limit). The quantized linear kernel library is built once per
prefetch distance (`-DFOLIO_QL_PREFETCH=N`, in positions; 0 = none, the
hardware prefetchers alone), and one pass over every quantized projection of
a GGUF model, one row each in model order (what a one-request decode step
reads: the layers and the LM head), is timed with each build, the builds
alternated pass by pass in one process, so that the machine's bandwidth,
which moves by tens of percent between minutes here, moves under all of them
alike. Between rounds the machine's read bandwidth (torch's sum of 1 GiB, 2
threads) is measured too, and each rate is given as a share of it.

    .venv/bin/python docs/bench/qlinear_prefetch.py MODEL.gguf [MODEL.gguf ...]
        [--distances 0,128,256,512] [--rows 1] [--rounds 5] [--mode 2] [--avx2]

(scripts/make_size_ggufs.py writes the 1B-8B models.)

With --builds the builds compared are named sets of compiler flags instead of
distances (`--builds "before=;after=-DFOLIO_QL_X=1"`), the way a kernel change
is measured against what it replaces (the int8 path's distance, in bytes:
`--builds "positions256=-DFOLIO_QL_PREFETCH_BYTES=0;8k=;12k=-DFOLIO_QL_PREFETCH_BYTES=12288"`;
--distances moves the float path's and, with -DFOLIO_QL_PREFETCH_BYTES=0,
the int8 path's); each build's speed-up over the first is given for the
passes below and above the run's median read bandwidth apart; --rows N times N rows a projection (a
32-request step, a prefill) and adds the arithmetic rate, and --avx2 builds
them as an AVX2-only CPU of the Zen 3 generation would (-mno-avx512f
-mno-avxvnni, as scripts/avx2_sim.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from folio import LLM
from folio.kernels import native


def quantized_weights(path: str) -> list:
    """Every IntGroups a decode step multiplies by, in model order (a fused
    layer of mixed types: each of its parts)."""
    llm = LLM(path, num_kv_blocks=16, max_num_seqs=1)
    model = llm.engine.executor.runner.model
    out, seen = [], set()
    for mod in model.modules():
        for v in vars(mod).values():
            if hasattr(v, "native_weight") and id(v) not in seen:
                seen.add(id(v))
                w = v.weights
                out.extend(w.parts if hasattr(w, "parts") else [w])
    return out


def read_bandwidth(a: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - start)
    return a.numel() * a.element_size() / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--distances", default="0,128,256,512")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mode", type=int, default=2, help="native.qlinear's quantize_x (2: int8)")
    p.add_argument("--avx2", action="store_true",
                   help="the AVX2 build (-mno-avx512f -mno-avxvnni), as an AVX2-only CPU runs it")
    p.add_argument("--builds", default="", metavar='"NAME=FLAGS;NAME=FLAGS"',
                   help="compare these builds (compiler flags) instead of distances")
    args = p.parse_args()
    torch.set_num_threads(2)
    extra = ("-mno-avx512f", "-mno-avxvnni") if args.avx2 else ()
    if args.builds:
        named = dict(b.split("=", 1) for b in args.builds.split(";"))
        libs = {name: native._build((*extra, *flags.split())) for name, flags in named.items()}
    else:
        libs = {int(d): native._build((*extra, f"-DFOLIO_QL_PREFETCH={d}"))
                for d in args.distances.split(",")}
    distances = list(libs)
    flags = native._cpu_flags().split()
    print("CPU flags: " + " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16",
                                                "avx512_vnni", "amx_tile") if f in flags)
          + (" (the AVX2 build, -mno-avx512f -mno-avxvnni)" if args.avx2 else "")
          + f"; {args.rows} row(s), quantize_x {args.mode}")
    big = torch.ones(1 << 28)
    print(f"| model | MB a pass | {'build' if args.builds else 'distance (positions)'} "
          "| ms a pass | GB/s | / read bandwidth | GMAC/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.models:
        ws = quantized_weights(path)
        nbytes = sum(w.nbytes for w in ws)
        macs = args.rows * sum(w.in_features * w.out_features for w in ws)
        xs = [torch.randn(args.rows, w.in_features) for w in ws]
        times = {d: [] for d in distances}
        shares = {d: [] for d in distances}
        paired = []                 # (bandwidth, {build: its time / the first build's})
        for _ in range(args.rounds):
            bw = read_bandwidth(big)
            for _ in range(3):
                got = {}
                for d, lib in libs.items():
                    start = time.perf_counter()
                    for w, x in zip(ws, xs):
                        native.qlinear(x, w, quantize_x=args.mode, lib=lib)
                    t = time.perf_counter() - start
                    times[d].append(t)
                    shares[d].append(nbytes / t / 1e9 / bw)
                    got[d] = t
                paired.append((bw, {d: got[distances[0]] / t for d, t in got.items()}))
        for d in distances:
            t = statistics.median(times[d])
            print(f"| {path.rsplit('/', 1)[-1]} | {nbytes / 1e6:.0f} | {d} | {t * 1e3:.2f} "
                  f"| {nbytes / t / 1e9:.1f} | {statistics.median(shares[d]):.2f} "
                  f"| {macs / t / 1e9:.0f} |", flush=True)
        # the machine's bandwidth moves between regimes (here 42-48 and 60-75
        # GB/s, for tens of seconds each): the speed-ups of each half apart
        mid = statistics.median(bw for bw, _ in paired)
        for name, half in (("at or below", [r for bw, r in paired if bw <= mid]),
                           ("above", [r for bw, r in paired if bw > mid])):
            print(f"speed-up over {distances[0]}, passes {name} the median read bandwidth "
                  f"({mid:.1f} GB/s): " + ", ".join(
                      f"{d} {statistics.median(r[d] for r in half):.3f}x" for d in distances[1:]))
        print(f"read bandwidth: {read_bandwidth(big):.1f} GB/s (torch sum, 2 threads)")


if __name__ == "__main__":
    main()
