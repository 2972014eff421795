"""Served against offline on the negligible model of `folio bench host` (issue
50): 256 concurrent streams through `folio serve` (driven by `folio bench
serve`, 4-token prompts, 64 output tokens each, EOS ignored) against the same
256 requests through `LLM.generate` in a process of its own, alternated round by
round. Output tokens per second over the whole run, prefill included, on one
engine thread (OMP_NUM_THREADS=1; the client runs beside the server on the
machine's other core).

    .venv/bin/python docs/bench/host_served.py [--rounds 3] [--before OLD_CHECKOUT]

The server runs as `folio serve` does and with `--engine-process` (the engine
core in a process of its own); --before also runs both through an older
checkout's src/ in the same rounds.
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

N, PROMPT, OUTPUT = 256, 4, 64
ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-num-seqs", str(N),
          "--max-num-batched-tokens", "2048", "--num-kv-blocks", str(N * 8 + 64)]

OFFLINE = """
import json, random, sys, time
from folio import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_num_seqs={n},
          max_num_batched_tokens=2048, num_kv_blocks={n} * 8 + 64)
rng = random.Random(0)
def run():
    prompts = [{{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range({p})]}}
               for _ in range({n})]
    params = SamplingParams(temperature=0, max_tokens={o}, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(x.outputs[0].token_ids) for x in outs) / (time.perf_counter() - t0)
run()
print(json.dumps(max(run() for _ in range(2))))
""".format(n=N, p=PROMPT, o=OUTPUT)


def env(src: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")


def offline(model: str, src: Path) -> float:
    out = subprocess.run([sys.executable, "-c", OFFLINE, model], env=env(src), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def served(model: str, src: Path, log: Path, extra: tuple = ()) -> float:
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
            rates = []
            for _ in range(3):          # the first warms the server up
                done = subprocess.run(bench, capture_output=True, text=True,
                                      env=env(ROOT / "src"))
                if done.returncode or not done.stdout.strip():
                    raise RuntimeError(f"bench serve failed: {done.stderr[-2000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]
                assert not result["failed"], result["errors"]
                rates.append(result["output_throughput"])
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
    rates: dict[str, dict[str, list[float]]] = {s: {"offline": [], "served": []} for s in sides}
    with tempfile.TemporaryDirectory(prefix="folio-served-") as tmp:
        model = host.make_model(Path(tmp) / "model")
        for r in range(args.rounds):
            for side, src in sides.items():
                extra = ("--engine-process",) if "--engine-process" in side else ()
                rates[side]["offline"].append(offline(model, src))
                rates[side]["served"].append(served(model, src, Path(tmp) / "server.log",
                                                    extra))
                print(f"round {r + 1}, {side}: offline {rates[side]['offline'][-1]:.0f}, "
                      f"served {rates[side]['served'][-1]:.0f} output tok/s", flush=True)
    print(f"\n{host._cpu()}; {N} requests of {PROMPT} prompt and {OUTPUT} output tokens, "
          f"{args.rounds} rounds\n")
    print("| checkout | offline tok/s (median) | served tok/s (median) | served / offline |")
    print("|---|---:|---:|---:|")
    for side, r in rates.items():
        off, srv = statistics.median(r["offline"]), statistics.median(r["served"])
        print(f"| {side} | {off:.0f} | {srv:.0f} | {srv / off:.2f} |")
    print("\n" + json.dumps(rates))


if __name__ == "__main__":
    main()
