"""The CPU at the sizes people run (issue 53): Folio beside llama.cpp's
llama-server on the same GGUF files of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B shapes (random weights, SmolLM2's tokenizer:
scripts/make_size_ggufs.py writes them), 2 threads each. The servers are all
started at once and wait idle; each workload then runs on one at a time, in
--rounds rounds alternating Folio and llama.cpp (ABBA), since this machine's
read bandwidth moves by tens of percent between minutes: each ratio is the
median of the rounds' own ratios, and each one-request rate is set against
the bandwidth measured just before and just after it, where the two agree
(the bandwidth here jumps between regimes, 42-48 and 60-80 GB/s, for tens
of seconds at a time: a run across a jump has no one roofline, and the
table says how many runs held).

Workloads (`folio bench serve`, streaming completions of token-id prompts,
EOS ignored, greedy):
- one request: 2 requests of 256 prompt and 256 output tokens, one at a time;
  its decode rate is 1000 / the median time per output token (prefill left
  out), and set against the roofline: the read bandwidth / the bytes a decode
  step reads (`folio bench weights`: the linear layers and the LM head, the
  embedding table when it is the head; and the KV cache's keys and values
  at the workload's mean decode context, 384 tokens, 2 bytes an element as
  both servers keep them: 1-2% of a step at 1B-8B);
- 32 requests: the standard workload (prompts 32-384, outputs 32-192 tokens,
  all sent at once), output tokens/s; llama-server with 16 slots; once (it
  runs for minutes), not in rounds;
- prefill: 2 requests of 1,024 prompt tokens and 1 output token, one at a
  time: 1,024 / the median time to first token.

    .venv/bin/python docs/bench/sizes.py /work/sizes/llama-1b-Q4_K_M.gguf ...
        [--avx2-sim] [--workloads one,32,prefill] [--rounds 3] [--save FILE]
        [--llama-isa avx512]

--avx2-sim: Folio as an AVX2-only CPU runs it (scripts/folio_as_avx2.py) and
llama.cpp built for AVX2 without AVX-512 (scripts/install_llama_cpp.sh avx2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_baselines import (ROOT, cpu_summary, decode_step_bytes,  # noqa: E402
                           drive_run, env_for, folio_cmd, free_port,
                           read_copy_bandwidth, stop, wait_up)

WORKLOADS = {
    "one": ["--num-prompts", "2", "--input-len", "256", "--output-len", "256",
            "--max-concurrency", "1"],
    "32": ["--num-prompts", "32", "--input-len", "32:384", "--output-len", "32:192"],
    "prefill": ["--num-prompts", "2", "--input-len", "1024", "--output-len", "1",
                "--max-concurrency", "1"],
}
WARM_UP = ["--num-prompts", "2", "--input-len", "64", "--output-len", "16"]


# the one-request workload's mean context while it decodes: 256 prompt tokens
# and half of its 256 output tokens
MEAN_DECODE_CONTEXT = 256 + 128


def kv_step_bytes(model: str, context: int = MEAN_DECODE_CONTEXT) -> int:
    """The keys and values a decode step of a GGUF's model reads at `context`
    tokens: layers x 2 x KV heads x head size x 2 bytes (bf16 in Folio on a CPU
    with it, f16 in llama.cpp) a token."""
    from gguf import GGUFReader
    fields = GGUFReader(model).fields
    arch = str(bytes(fields["general.architecture"].parts[-1]), "utf-8")

    def get(key: str, default=None):
        f = fields.get(f"{arch}.{key}")
        return default if f is None else int(f.parts[f.data[0]][0])
    heads = get("attention.head_count")
    head_dim = get("attention.key_length", get("embedding_length") // heads)
    return get("block_count") * 2 * get("attention.head_count_kv", heads) * head_dim * 2 * context


def bench(args, url: str, model: str, flags: list[str]) -> dict:
    return drive_run(args, url, ["--tokenizer", model, *flags])


def rate(w: str, r: dict) -> float:
    """A workload's figure from `folio bench serve`'s summary."""
    if w == "one":
        return 1000 / r["tpot_ms"]["median"]
    if w == "32":
        return r["output_throughput"]
    return 1024 / (r["ttft_ms"]["median"] / 1000)


# a one-request run's bandwidth held when the measures before and after it
# differ by at most this share of the smaller
STEADY = 0.15

KEYS = {"one": "one request decode tok/s", "32": "32 requests tok/s", "prefill": "prefill tok/s"}


def run_servers(args, servers: dict, model: str, workloads: list[str], tmp: Path) -> dict:
    """Start every server at once (idle, each waits), warm each, then run the
    workloads in rounds, Folio and llama.cpp alternating (ABBA: the first in
    one round is the last in the next), so that the machine's bandwidth,
    which moves by tens of percent between minutes here, moves under both
    alike. Each one-request run is bracketed by measures of the read
    bandwidth (before it and after it). The 32-request workload runs once
    (minutes long itself).
    {system: {key: [rates]}}, with "bandwidth" {system: [(GB/s before, GB/s after)
    each of its one-request runs]}."""
    procs, urls, logs = {}, {}, []
    out: dict = {"folio": {}, "llama.cpp": {}, "bandwidth": {}}
    try:
        for name, cmd in servers.items():
            port = free_port()
            cmd = [c if c != "PORT" else str(port) for c in cmd]
            log = open(tmp / f"sizes-{name}-{Path(model).stem}.log", "w")
            logs.append(log)
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           env=env_for(args))
            urls[name] = f"http://127.0.0.1:{port}"
        for name in servers:
            wait_up(urls[name], procs[name], 900)
            bench(args, urls[name], model, WARM_UP)
        for i in range(args.rounds):
            for w in workloads:
                if w == "32" and i:
                    continue
                pair = [("folio", "folio"), ("llama.cpp", "llama16" if w == "32" else "llama1")]
                if i % 2:
                    pair.reverse()
                # prompts of their own each round: a repeated one is a prefix-cache hit
                flags = WORKLOADS[w] + ["--seed", str(1000 + i)]
                before = read_copy_bandwidth(args)["read GB/s"] if w == "one" else None
                for system, server in pair:
                    got = rate(w, bench(args, urls[server], model, flags))
                    out[system].setdefault(KEYS[w], []).append(got)
                    if w == "one":      # each run between two measures of the bandwidth
                        after = read_copy_bandwidth(args)["read GB/s"]
                        out["bandwidth"].setdefault(system, []).append((before, after))
                        before = after
                around = lambda system: ("" if w != "one" else " (GB/s %.1f-%.1f)"
                                         % out["bandwidth"][system][-1])
                print(f"  round {i + 1}, {w}: folio {out['folio'][KEYS[w]][-1]:.1f}"
                      f"{around('folio')}, llama.cpp {out['llama.cpp'][KEYS[w]][-1]:.1f}"
                      f"{around('llama.cpp')}", flush=True)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"  FAILED: {e}", flush=True)
        out["error"] = str(e)
    finally:
        for proc in procs.values():
            stop(proc, 60)
        for log in logs:
            log.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--avx2-sim", action="store_true")
    p.add_argument("--workloads", default="one,32,prefill")
    p.add_argument("--save", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=3,
                   help="alternated rounds of the one-request and prefill workloads")
    p.add_argument("--llama-isa", default=None,
                   help="which build of scripts/install_llama_cpp.sh (default: avx2 with "
                        "--avx2-sim, else native; avx512 where AMX crashes llama.cpp)")
    args = p.parse_args()
    isa = args.llama_isa or ("avx2" if args.avx2_sim else "native")
    llama = ROOT / "build" / "llama.cpp" / isa / "bin" / "llama-server"
    if not llama.exists():
        sys.exit(f"no {llama}: run scripts/install_llama_cpp.sh {isa} first")
    workloads = args.workloads.split(",")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "cpu": cpu_summary(), "avx2_sim": args.avx2_sim, "llama_isa": isa}
    print(f"{meta['date']} | {meta['cpu']} | AVX2 simulated: {args.avx2_sim} | "
          f"llama.cpp build: {isa}", flush=True)
    rows = []
    tmp = Path("/tmp")
    for model in args.models:
        name = Path(model).stem
        bw = read_copy_bandwidth(args)["read GB/s"]
        weights, kv = decode_step_bytes(args, model), kv_step_bytes(model)
        nbytes = weights + kv
        print(f"{name}: read bandwidth {bw:.1f} GB/s, a decode step reads {nbytes / 1e6:.0f} MB "
              f"({weights / 1e6:.0f} MB of weights, {kv / 1e6:.1f} MB of KV cache at "
              f"{MEAN_DECODE_CONTEXT} tokens; roofline {bw * 1e9 / nbytes:.1f} tok/s)", flush=True)
        servers = {"folio": [*folio_cmd(args), "serve", "--model", model, "--port", "PORT"]}
        for slots, ws in ((1, {"one", "prefill"}), (16, {"32"})):
            if ws & set(workloads):
                servers[f"llama{slots}"] = [
                    str(llama), "-m", model, "-t", "2", "-tb", "2", "-np", str(slots),
                    "-c", str(max(2048, slots * 1024)), "--host", "127.0.0.1", "--port",
                    "PORT", "--no-webui"]
        got = run_servers(args, servers, model, workloads, tmp)
        rows.append({"model": name, "read GB/s": bw, "step bytes": nbytes, "kv bytes": kv, **got,
                     "bandwidth after": read_copy_bandwidth(args)["read GB/s"]})
    print(f"\n{meta['date']} | {meta['cpu']} | AVX2 simulated: {args.avx2_sim} | "
          f"{args.rounds} round(s), medians")
    print("| file | read GB/s (min-max) | roofline tok/s | one request: Folio | llama.cpp "
          "| Folio / roofline | llama.cpp / roofline | Folio / llama.cpp "
          "| 32 requests: Folio | llama.cpp | ratio | prefill: Folio | llama.cpp | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = statistics.median

    def cell(d, k):
        return f"{med(d[k]):.1f}" if d.get(k) else "-"

    def ratio(a, b, k):
        """The median of the rounds' own ratios (each pair minutes apart at most)."""
        if not (a.get(k) and b.get(k)):
            return "-"
        return f"{med(x / y for x, y in zip(a[k], b[k])):.2f}x"

    def shares(r, system):
        """Each one-request rate over the roofline of the bandwidth measured
        around it, the runs whose bandwidth held (before and after within
        STEADY of each other) only: this machine's moves between regimes
        (42-48 and 60-80 GB/s here) for tens of seconds at a time, and a run
        across a change has no one roofline. "-" when none held."""
        got = [x * r["step bytes"] / ((a + b) / 2 * 1e9)
               for x, (a, b) in zip(r[system].get(KEYS["one"], []),
                                    r["bandwidth"].get(system, []))
               if abs(a - b) <= STEADY * min(a, b)]
        runs = len(r["bandwidth"].get(system, []))
        return f"{med(got):.0%} ({len(got)} of {runs})" if got else "-"
    for r in rows:
        f, l1 = r["folio"], r["llama.cpp"]
        one = KEYS["one"]
        bws = [b for pair in r["bandwidth"].get("folio", []) for b in pair] or [r["read GB/s"]]
        roof = med(bws) * 1e9 / r["step bytes"]
        print(f"| {r['model']} | {min(bws + [r['bandwidth after']]):.1f}-"
              f"{max(bws + [r['bandwidth after']]):.1f} "
              f"| {roof:.1f} | {cell(f, one)} | {cell(l1, one)} | {shares(r, 'folio')} "
              f"| {shares(r, 'llama.cpp')} "
              f"| {ratio(f, l1, one)} | {cell(f, KEYS['32'])} "
              f"| {cell(l1, KEYS['32'])} | {ratio(f, l1, KEYS['32'])} "
              f"| {cell(f, KEYS['prefill'])} | {cell(l1, KEYS['prefill'])} "
              f"| {ratio(f, l1, KEYS['prefill'])} |")
    if args.save:
        args.save.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
