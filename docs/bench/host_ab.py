"""`folio bench host` before and after, in one run (issue 50).

    .venv/bin/python docs/bench/host_ab.py --before /path/to/older/checkout [--rounds 2]

Runs src/folio/bench/host.py of this checkout as a script, once with this
checkout's `folio` and once with the --before checkout's (PYTHONPATH=OLD/src;
the benchmark reaches the engine only through LLM.generate and the model's
forward and compute_logits, which both have), alternating, and prints the
tables side by side. Each run is a fresh process on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "src" / "folio" / "bench" / "host.py"


def one(src: Path, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", *extra], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="an older checkout (its src/ is used)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two")
    args, extra = p.parse_known_args()
    runs: dict[str, list[dict]] = {"before": [], "after": [], "ahead": []}
    for _ in range(args.rounds):
        runs["before"].append(one(Path(args.before).resolve() / "src", extra))
        runs["after"].append(one(ROOT / "src", extra))
        runs["ahead"].append(one(ROOT / "src", [*extra, "--async-scheduling"]))
    first = runs["after"][0]
    print(f"CPU: {first['cpu']}; {first['steps']} decode steps a measurement, "
          f"{args.rounds} rounds alternating (the best of each side)\n")
    print("| batch | before: step ms | host ms | after: step ms | host ms | host µs/seq "
          "| step before/after |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in first["step_ms"]:
        bs = min(r["step_ms"][b] for r in runs["before"])
        bh = min(r["host_ms"][b] for r in runs["before"])
        as_ = min(r["step_ms"][b] for r in runs["after"])
        ah = min(r["host_ms"][b] for r in runs["after"])
        print(f"| {b} | {bs:.2f} | {bh:.2f} | {as_:.2f} | {ah:.2f} | {1e3 * ah / int(b):.1f} "
              f"| {bs / as_:.2f}x |")
    for b in first["step_ms"]:
        ah = min(r["step_ms"][b] for r in runs["ahead"])
        print(f"| {b}, --async-scheduling | | | {ah:.2f} | | | |")
    print("\n| batch | D ms | before: period ms | / (D + its step) | after, --async-scheduling: "
          "period ms | / max(D, its step) | / (D + its step) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, s in enumerate(first["stand_in"]):
        b = min((r["stand_in"][i] for r in runs["before"]), key=lambda x: x["period_ms"])
        a = min((r["stand_in"][i] for r in runs["ahead"]), key=lambda x: x["period_ms"])
        print(f"| {s['batch']} | {s['device_ms']:g} | {b['period_ms']:.2f} | {b['of_sum']:.2f} "
              f"| {a['period_ms']:.2f} | {a['of_max']:.2f} | {a['of_sum']:.2f} |")
    print("\n" + json.dumps(runs))


if __name__ == "__main__":
    main()
