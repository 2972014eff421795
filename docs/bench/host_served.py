"""Served against offline on the negligible model of `folio bench host` (issue
50): 256 concurrent streams through `folio serve` (driven by `folio bench
serve`, 4-token prompts, 64 output tokens each, EOS ignored) against the same
256 requests through `LLM.generate` in a process of its own, alternated round by
round, on one engine thread (OMP_NUM_THREADS=1).

Two figures each:
- output tokens per second over the whole run, prefill and the client's
  connections included;
- the engine's step rate: steps per second of busy time (StepStats'
  num_steps and busy_seconds: from a busy spell's first step to the end of
  its last, whatever the loop does between steps included; served: the
  server's `folio:engine_steps_total` and `folio:engine_busy_seconds_total`
  before and after the run).

    .venv/bin/python docs/bench/host_served.py [--rounds 3] [--before OLD_CHECKOUT]

The server runs as `folio serve` does (the engine a thread of the server) and
with `--engine-process` (the engine core in a process of its own). With the
core in its own process, CPUs are placed as on a GPU server, where the
engine's process has a core to itself: the core on CPU 0, the server's front
process and the benchmark client on CPU 1 (sched_setaffinity); offline runs on
CPU 0. In one process nothing is placed (the engine thread and the event loop
share the process; the client runs beside it). --before also runs both
through an older checkout's src/ in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src" / "folio" / "bench"))
import cpu_baselines as cb  # noqa: E402
import host  # noqa: E402

N, PROMPT, OUTPUT = 256, 4, 64
ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-num-seqs", str(N),
          "--max-num-batched-tokens", "2048", "--num-kv-blocks", str(N * 8 + 64)]

OFFLINE = """
import json, os, random, sys, time
if os.environ.get("FOLIO_BENCH_CPU"):
    os.sched_setaffinity(0, {{int(os.environ["FOLIO_BENCH_CPU"])}})
from folio import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_num_seqs={n},
          max_num_batched_tokens=2048, num_kv_blocks={n} * 8 + 64)
rng = random.Random(0)
def run():
    prompts = [{{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range({p})]}}
               for _ in range({n})]
    params = SamplingParams(temperature=0, max_tokens={o}, ignore_eos=True)
    e = llm.engine
    counted = hasattr(e, "num_steps")       # (not in checkouts before the counters)
    steps, busy = (e.num_steps, e.busy_seconds) if counted else (0, 0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    rate = sum(len(x.outputs[0].token_ids) for x in outs) / (time.perf_counter() - t0)
    return rate, (e.num_steps - steps) / (e.busy_seconds - busy) if counted else 0.0
run()
print(json.dumps(max(run() for _ in range(2))))
""".format(n=N, p=PROMPT, o=OUTPUT)


def env(src: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")


def offline(model: str, src: Path, cpu: "int | None") -> tuple[float, float]:
    environ = env(src)
    if cpu is not None:
        environ["FOLIO_BENCH_CPU"] = str(cpu)
    out = subprocess.run([sys.executable, "-c", OFFLINE, model], env=environ, check=True,
                         capture_output=True, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def _core_pid(server: int) -> int:
    """The engine core: the server's child that is not multiprocessing's
    resource tracker."""
    kids = Path(f"/proc/{server}/task/{server}/children").read_text().split()
    for kid in kids:
        if "resource_tracker" not in Path(f"/proc/{kid}/cmdline").read_text():
            return int(kid)
    raise RuntimeError(f"the server {server} has no engine core process")


def _engine_counts(url: str) -> tuple[float, float]:
    """The server's engine steps and busy seconds so far (/metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        for name in ("folio:engine_steps_total", "folio:engine_busy_seconds_total"):
            if line.startswith(name + "{"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return (found.get("folio:engine_steps_total", 0.0),       # (0: a checkout without them)
            found.get("folio:engine_busy_seconds_total", 0.0))


def _place(pid: int, cpus: set) -> None:
    """Every thread of a process on these CPUs (a process's affinity set by
    its pid holds only for its main thread and the threads it starts after)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def served(model: str, src: Path, log: Path, extra: tuple = (),
           place: bool = False) -> tuple[float, float]:
    """(output tok/s, decode steps/s) of the best of 2 runs after a warm-up."""
    port = cb.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from folio.cli import main; main()", "serve", model,
           "--port", str(port), *ENGINE, *extra]
    bench = [sys.executable, "-c", "from folio.cli import main; main()", "bench", "serve",
             "--base-url", url, "--tokenizer", model, "--seed", "0", "--json",
             "--num-prompts", str(N),
             "--max-concurrency", str(N), "--input-len", str(PROMPT),
             "--output-len", str(OUTPUT)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(src))
        try:
            cb.wait_up(url, proc, 300)
            if place:        # the core alone on CPU 0; the front and the client on CPU 1
                _place(_core_pid(proc.pid), {0})
                _place(proc.pid, {1})
            rates = []
            for _ in range(3):          # the first warms the server up
                steps, busy = _engine_counts(url)
                done = subprocess.run(bench, capture_output=True, text=True,
                                      env=env(ROOT / "src"),
                                      preexec_fn=(lambda: os.sched_setaffinity(0, {1}))
                                      if place else None)
                if done.returncode or not done.stdout.strip():
                    raise RuntimeError(f"bench serve failed: {done.stderr[-2000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]
                assert not result["failed"], result["errors"]
                steps_after, busy_after = _engine_counts(url)
                rates.append((result["output_throughput"],
                              (steps_after - steps) / (busy_after - busy)
                              if busy_after > busy else 0.0))
            return max(rates[1:])
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="an older checkout (its src/ is used)")
    args = p.parse_args()
    sides = {"after": ROOT / "src", "after, --engine-process": ROOT / "src"}
    if args.before:
        sides["before"] = Path(args.before).resolve() / "src"
        sides["before, --engine-process"] = Path(args.before).resolve() / "src"
    keys = ("offline", "served", "offline_steps", "served_steps")
    rates: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in sides}
    with tempfile.TemporaryDirectory(prefix="folio-served-") as tmp:
        model = host.make_model(Path(tmp) / "model")
        for r in range(args.rounds):
            for side, src in sides.items():
                place = "--engine-process" in side
                extra = ("--engine-process",) if place else ()
                off = offline(model, src, 0 if place else None)
                srv = served(model, src, Path(tmp) / "server.log", extra, place)
                for key, value in zip(keys, (off[0], srv[0], off[1], srv[1])):
                    rates[side][key].append(value)
                print(f"round {r + 1}, {side}: offline {off[0]:.0f} tok/s, {off[1]:.0f} "
                      f"steps/s; served {srv[0]:.0f} tok/s, {srv[1]:.0f} steps/s", flush=True)
    print(f"\n{host._cpu()}; {N} requests of {PROMPT} prompt and {OUTPUT} output tokens, "
          f"{args.rounds} rounds, medians\n")
    print("| checkout | offline tok/s | served tok/s | served / offline | offline steps/s "
          "| served steps/s | served / offline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side, r in rates.items():
        m = {k: statistics.median(v) for k, v in r.items()}
        steps = (f"{m['offline_steps']:.0f} | {m['served_steps']:.0f} | "
                 f"{m['served_steps'] / m['offline_steps']:.2f}" if m["offline_steps"]
                 else "not counted | not counted | -")
        print(f"| {side} | {m['offline']:.0f} | {m['served']:.0f} | "
              f"{m['served'] / m['offline']:.2f} | {steps} |")
    print("\n" + json.dumps(rates))


if __name__ == "__main__":
    main()
