"""What a container's CPU limit does to the engine, and what sizing the thread
pool by the quota gives back: `folio bench throughput` in a cgroup with a CPU
quota (a Kubernetes `limits.cpu`, a `docker run --cpus`), once with Folio's
default (threads from the quota) and once with one thread per visible CPU (what
Folio did before: OMP_NUM_THREADS set to the CPUs the process may run on),
alternated, each in a fresh process. Needs root (it creates the cgroup).

    sudo .venv/bin/python docs/bench/cpu_quota.py [--cpus 1] [--rounds 2] [--num-prompts 16]
"""

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from folio.env_report import cpu_info  # noqa: E402
from folio.worker.cpu_threads import affinity_cpus  # noqa: E402
from tests.worker.test_cpu_threads import make_cpu_cgroup, remove_cgroup  # noqa: E402


def run_in(procs: Path, env: dict, args: list[str]) -> dict:
    cmd = ["sh", "-c", f'echo $$ > "{procs}" && exec "$0" -m folio.cli "$@"', sys.executable,
           "bench", "throughput", "--json", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpus", type=float, default=1.0, help="the quota, in CPUs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", default="16")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    d, procs = make_cpu_cgroup(f"folio-bench-{uuid.uuid4().hex[:8]}", a.cpus)
    if d is None:
        sys.exit(f"no cgroup: {procs}")
    visible = affinity_cpus()
    model, flags = cpu_info()
    print(f"{model}; {visible} CPUs visible, quota {a.cpus:g} CPUs; avx512_bf16="
          f"{'avx512_bf16' in flags} avx2={'avx2' in flags}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| round | threads | why | output tok/s |")
    print("|---|---|---|---|")
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    args = ["--num-prompts", a.num_prompts, "--dtype", a.dtype]
    try:
        for r in range(1, a.rounds + 1):
            for label, env in (("quota (default)", base),
                               ("one per visible CPU", {**base, "OMP_NUM_THREADS": str(visible)})):
                res = run_in(procs, env, args)
                print(f"| {r} | {res['threads']} | {label} | {res['output_tokens_per_s']:.1f} |",
                      flush=True)
    finally:
        remove_cgroup(d)


if __name__ == "__main__":
    main()
