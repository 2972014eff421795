"""Served against offline on the negligible model of `folio bench host` (issue
50): 256 concurrent streams through `folio serve` (4-token prompts, 512
output tokens each, EOS ignored) against the same 256 requests through
`LLM.generate` in a process of its own, alternated round by round, on one
engine thread (OMP_NUM_THREADS=1).

Two figures each:
- output tokens per second over the whole run (served: from the first
  request sent to the last chunk; the client's connections, the server's
  request handling, the prefill and what the front end holds back included);
- the engine's step rate with the 256 running: steps per busy second
  (StepStats' num_steps and busy_seconds, the time between steps included).
  Served: /metrics read every 0.1 s during the run, and the longest stretch
  of readings with at least 95% of the 256 running and none waiting taken
  (the first stream may have run alone at the start, and ended early)
  (`folio:engine_steps_total` and `folio:engine_busy_seconds_total` at its
  ends; one step's StepStats carry the counts and the counters alike, so a
  front end behind its core shifts the readings, not what they say).
  Offline: the same counters over `LLM.generate` (one prompt step, 511
  decode steps, every one with 256 rows).

The client is a small aiohttp one in this script (one connection a stream):
on 2 cores `folio bench serve`, whose per-chunk accounting costs more, would
take more of the CPU the server needs.

    .venv/bin/python docs/bench/host_served.py [--rounds 3] [--before OLD_CHECKOUT]

The server runs as `folio serve` does (the engine core in a process of its
own) and with `--no-engine-process` (the engine a thread of the server).
With the core in its own process, CPUs are placed as on a GPU server, where
the engine's process has a core to itself: the core on CPU 0, the server's
front process and the client on CPU 1 (sched_setaffinity, every thread);
offline then runs on CPU 0. In one process nothing is placed (the engine
thread and the event loop share the process; the client runs beside it).
--before also runs both through an older checkout's src/ in the same rounds
(one from before the core process was the default: its default and
`--engine-process`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src" / "folio" / "bench"))
import cpu_baselines as cb  # noqa: E402
import host  # noqa: E402

N, PROMPT, OUTPUT = 256, 4, 512
BLOCKS = N * ((PROMPT + OUTPUT) // 16 + 2) + 64
ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-num-seqs", str(N),
          "--max-num-batched-tokens", "2048", "--num-kv-blocks", str(BLOCKS),
          "--uvicorn-log-level", "warning"]

OFFLINE = """
import json, os, random, sys, time
if os.environ.get("FOLIO_BENCH_CPU"):
    os.sched_setaffinity(0, {{int(os.environ["FOLIO_BENCH_CPU"])}})
from folio import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_num_seqs={n},
          max_num_batched_tokens=2048, num_kv_blocks={blocks})
rng = random.Random(0)
def run():
    prompts = [{{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range({p})]}}
               for _ in range({n})]
    params = SamplingParams(temperature=0, max_tokens={o}, ignore_eos=True)
    e = llm.engine
    counted = hasattr(e, "num_steps")       # (not in checkouts before the counters)
    steps, busy = (e.num_steps, e.busy_seconds) if counted else (0, 0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    rate = sum(len(x.outputs[0].token_ids) for x in outs) / (time.perf_counter() - t0)
    return rate, (e.num_steps - steps) / (e.busy_seconds - busy) if counted else 0.0
run()
print(json.dumps(max(run() for _ in range(2))))
""".format(n=N, p=PROMPT, o=OUTPUT, blocks=BLOCKS)

CLIENT = """
import asyncio, json, random, sys, time
import aiohttp
url, n, p, o = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
NAMES = ("folio:num_requests_running", "folio:num_requests_waiting",
         "folio:engine_steps_total", "folio:engine_busy_seconds_total")

async def readings(session, out, done):
    # /metrics every 0.1 s: (running, waiting, steps, busy seconds), all from
    # the same step's StepStats
    while not done.is_set():
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        found = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in NAMES:
                found[name] = float(line.rsplit(" ", 1)[1])
        out.append(tuple(found.get(name, 0.0) for name in NAMES))
        try:
            await asyncio.wait_for(done.wait(), 0.1)
        except asyncio.TimeoutError:
            pass

async def one(session, ids):
    body = {"model": "m", "prompt": ids, "max_tokens": o, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    return time.perf_counter(), usage["completion_tokens"]

def full_rate(samples):
    # steps per busy second over the longest run of readings with (nearly) all
    # n running: one stream may have run alone at the start and ended early
    best, run = (0, 0.0), []
    for sample in samples + [(0, 0, 0, 0)]:
        if sample[0] >= 0.95 * n and sample[1] == 0:
            run.append(sample)
            continue
        if len(run) >= 2 and run[-1][2] - run[0][2] > best[0]:
            best = (run[-1][2] - run[0][2], run[-1][3] - run[0][3])
        run = []
    return best[0] / best[1] if best[1] > 0 else 0.0

async def run():
    prompts = [[rng.randrange(3, 4000) for _ in range(p)] for _ in range(n)]
    samples, done = [], asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        reader = asyncio.ensure_future(readings(session, samples, done))
        t0 = time.perf_counter()
        ends = await asyncio.gather(*(one(session, ids) for ids in prompts))
        done.set()
        await reader
    assert all(tokens == o for _, tokens in ends)
    end = max(t for t, _ in ends)
    print(json.dumps([n * o / (end - t0), full_rate(samples)]))

asyncio.run(run())
"""


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


def _place(pid: int, cpus: set) -> None:
    """Every thread of a process on these CPUs (a process's affinity set by
    its pid holds only for its main thread and the threads it starts after)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def served(model: str, src: Path, log: Path, extra: tuple = (),
           place: bool = False) -> tuple[float, float]:
    """(output tok/s, engine steps per busy second with every stream running),
    the best of 2 runs after a warm-up."""
    port = cb.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from folio.cli import main; main()", "serve", model,
           "--port", str(port), "--served-model-name", "m", *ENGINE, *extra]
    client = [sys.executable, "-c", CLIENT, url, str(N), str(PROMPT), str(OUTPUT)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(src))
        try:
            cb.wait_up(url, proc, 300)
            if place:        # the core alone on CPU 0; the front and the client on CPU 1
                _place(_core_pid(proc.pid), {0})
                _place(proc.pid, {1})
            rates = []
            for _ in range(3):          # the first warms the server up
                done = subprocess.run(client, capture_output=True, text=True,
                                      env=env(ROOT / "src"),
                                      preexec_fn=(lambda: os.sched_setaffinity(0, {1}))
                                      if place else None)
                if done.returncode or not done.stdout.strip():
                    raise RuntimeError(f"the client failed: {done.stderr[-2000:]}")
                rates.append(tuple(json.loads(done.stdout.strip().splitlines()[-1])))
                if done.stderr.strip():
                    print(done.stderr.strip(), flush=True)
            # the best of each (a run whose readings saw no step between them: 0)
            return max(r[0] for r in rates[1:]), max(r[1] for r in rates[1:])
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="an older checkout (its src/ is used)")
    args = p.parse_args()
    # name -> (src, folio serve's flags, whether the engine has a process of its own)
    sides = {"after (core process, the default)": (ROOT / "src", (), True),
             "after, --no-engine-process": (ROOT / "src", ("--no-engine-process",), False)}
    if args.before:
        before = Path(args.before).resolve() / "src"
        sides["before (engine thread, its default)"] = (before, (), False)
        sides["before, --engine-process"] = (before, ("--engine-process",), True)
    keys = ("offline", "served", "offline_steps", "served_steps")
    rates: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in sides}
    with tempfile.TemporaryDirectory(prefix="folio-served-") as tmp:
        model = host.make_model(Path(tmp) / "model")
        for r in range(args.rounds):
            for side, (src, extra, place) in sides.items():
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
        print(f"| {side} | {m['offline']:.0f} | {m['served']:.0f} | "
              f"{m['served'] / m['offline']:.2f} | " + (
                  f"{m['offline_steps']:.0f} | {m['served_steps']:.0f} | "
                  f"{m['served_steps'] / m['offline_steps']:.2f} |" if m["offline_steps"]
                  else "not counted | not counted | - |"))
    print("\n" + json.dumps(rates))


if __name__ == "__main__":
    main()
