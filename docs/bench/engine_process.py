"""The default model served with the engine core in a process of its own (the
default since issue 50) against the engine in a thread of the server
(`--no-engine-process`), alternated round by round: cpu_baselines.py's two
workloads (32 requests of 32-384 prompt and 32-192 output tokens at once;
one request at a time, 256 and 256), driven by `folio bench serve`, the
GGUF's codes as `folio serve` runs them, 2 threads.

    .venv/bin/python docs/bench/engine_process.py [--rounds 3] [--before OLD_CHECKOUT]

--before adds an older checkout's `folio serve` with its own default (its
src/ on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_baselines as cb  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="an older checkout (its src/ is used)")
    args = p.parse_args()
    args.avx2_sim = False
    sides = {"core process (the default)": (cb.folio_cmd(args), [], None),
             "--no-engine-process": (cb.folio_cmd(args), ["--no-engine-process"], None)}
    if args.before:
        sides["before (its default)"] = (cb.before_cmd(args), [], cb.before_env(args))
    rates: dict = {side: {w: [] for w in cb.WORKLOADS} for side in sides}
    with tempfile.TemporaryDirectory(prefix="folio-engine-process-") as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1}", flush=True)
            for side, (cmd, flags, env) in sides.items():
                port = cb.free_port()
                got = cb.serve(args, side, [*cmd, "serve", "--dtype", "float32", *flags,
                                            "--port", str(port)],
                               port, Path(tmp) / "server.log", env=env)
                if "error" in got:
                    raise SystemExit(f"{side} failed: {got['error']}")
                for w, rate in got.items():
                    rates[side][w].append(rate)
    print(f"\n{cb.cpu_summary()}; {args.rounds} rounds, medians (output tok/s)\n")
    print("| server | " + " | ".join(cb.WORKLOADS) + " |")
    print("|---|" + "---:|" * len(cb.WORKLOADS))
    for side, r in rates.items():
        print(f"| {side} | " + " | ".join(f"{statistics.median(r[w]):.1f}"
                                          for w in cb.WORKLOADS) + " |")
    print("\n" + repr(rates))


if __name__ == "__main__":
    main()
