"""The default model served with the engine core in a process of its own (the
default since issue 50) against the engine in a thread of the server
(`--no-engine-process`), alternated round by round: cpu_baselines.py's two
workloads (32 requests of 32-384 prompt and 32-192 output tokens at once;
one request at a time, 256 and 256), driven by `folio bench serve`, the
GGUF's codes as `folio serve` runs them, 2 threads. Each server runs the
standard workload once to warm up (a server's first run of it is 10-25%
slower, either way), then each workload twice; the better of the two counts.

    .venv/bin/python docs/bench/engine_process.py [--rounds 3] [--before OLD_CHECKOUT]

--before adds an older checkout's `folio serve` with its own default (its
src/ on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_baselines as cb  # noqa: E402


def serve(args, cmd: list, log: Path, env) -> dict:
    """A server started, warmed up, each workload's better of two runs."""
    port = cb.free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env or cb.env_for(args))
        try:
            cb.wait_up(url, proc, 600)
            cb.drive(args, url, cb.WARM_UP)
            cb.drive(args, url, cb.WORKLOADS["standard"])
            return {w: max(cb.drive(args, url, flags) for _ in range(2))
                    for w, flags in cb.WORKLOADS.items()}
        finally:
            proc.terminate()
            proc.wait(30)


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
                got = serve(args, [*cmd, "serve", "--dtype", "float32", *flags],
                            Path(tmp) / "server.log", env)
                for w, rate in got.items():
                    rates[side][w].append(rate)
                    print(f"  {side}, {w}: {rate:.1f} output tok/s", flush=True)
    print(f"\n{cb.cpu_summary()}; {args.rounds} rounds, medians (output tok/s)\n")
    print("| server | " + " | ".join(cb.WORKLOADS) + " |")
    print("|---|" + "---:|" * len(cb.WORKLOADS))
    for side, r in rates.items():
        print(f"| {side} | " + " | ".join(f"{statistics.median(r[w]):.1f}"
                                          for w in cb.WORKLOADS) + " |")
    print("\n" + repr(rates))


if __name__ == "__main__":
    main()
