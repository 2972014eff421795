"""The CPU at the sizes people run (issue 53): Folio beside llama.cpp's
llama-server on the same GGUF files of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B shapes (random weights, SmolLM2's tokenizer:
scripts/make_size_ggufs.py writes them), each server alone on the machine, 2
threads, one after the other, with the machine's read bandwidth measured
before each file's pair.

Workloads (`folio bench serve`, streaming completions of token-id prompts,
EOS ignored, greedy):
- one request: 2 requests of 256 prompt and 256 output tokens, one at a time;
  its decode rate is 1000 / the median time per output token (prefill left
  out), and set against the roofline: the read bandwidth / the bytes a decode
  step reads (`folio bench weights`: the linear layers and the LM head, the
  embedding table when it is the head);
- 32 requests: the standard workload (prompts 32-384, outputs 32-192 tokens,
  all sent at once), output tokens/s; llama-server with 16 slots;
- prefill: 2 requests of 1,024 prompt tokens and 1 output token, one at a
  time: 1,024 / the median time to first token.

    .venv/bin/python docs/bench/sizes.py /work/sizes/llama-1b-Q4_K_M.gguf ...
        [--avx2-sim] [--workloads one,32,prefill] [--save FILE]

--avx2-sim: Folio as an AVX2-only CPU runs it (scripts/folio_as_avx2.py) and
llama.cpp built for AVX2 without AVX-512 (scripts/install_llama_cpp.sh avx2).
"""

from __future__ import annotations

import argparse
import json
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


def bench(args, url: str, model: str, flags: list[str]) -> dict:
    return drive_run(args, url, ["--tokenizer", model, *flags])


def run_server(args, name: str, cmd: list[str], port: int, model: str, workloads: list[str],
               log: Path) -> dict:
    url = f"http://127.0.0.1:{port}"
    out: dict = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env_for(args))
        try:
            wait_up(url, proc, 900)
            bench(args, url, model, WARM_UP)
            for w in workloads:
                r = bench(args, url, model, WORKLOADS[w])
                if w == "one":
                    out["one request decode tok/s"] = 1000 / r["tpot_ms"]["median"]
                elif w == "32":
                    out["32 requests tok/s"] = r["output_throughput"]
                else:
                    out["prefill tok/s"] = 1024 / (r["ttft_ms"]["median"] / 1000)
                print(f"  {name}: {out}", flush=True)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"  {name} FAILED: {e}\n{log.read_text()[-1500:]}", flush=True)
            out["error"] = str(e)
        finally:
            stop(proc, 60)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--avx2-sim", action="store_true")
    p.add_argument("--workloads", default="one,32,prefill")
    p.add_argument("--save", type=Path, default=None)
    args = p.parse_args()
    isa = "avx2" if args.avx2_sim else "native"
    llama = ROOT / "build" / "llama.cpp" / isa / "bin" / "llama-server"
    if not llama.exists():
        sys.exit(f"no {llama}: run scripts/install_llama_cpp.sh {isa} first")
    workloads = args.workloads.split(",")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "cpu": cpu_summary(), "avx2_sim": args.avx2_sim}
    print(f"{meta['date']} | {meta['cpu']} | AVX2 simulated: {args.avx2_sim}", flush=True)
    rows = []
    tmp = Path("/tmp")
    for model in args.models:
        name = Path(model).stem
        bw = read_copy_bandwidth(args)["read GB/s"]
        nbytes = decode_step_bytes(args, model)
        print(f"{name}: read bandwidth {bw:.1f} GB/s, a decode step reads {nbytes / 1e6:.0f} MB "
              f"(roofline {bw * 1e9 / nbytes:.1f} tok/s)", flush=True)
        port = free_port()
        folio = run_server(args, "folio", [*folio_cmd(args), "serve", "--model", model,
                                           "--port", str(port)], port, model, workloads,
                           tmp / f"sizes-folio-{name}.log")
        llama_rows = {}
        for slots, ws in ((1, [w for w in workloads if w != "32"]),
                          (16, [w for w in workloads if w == "32"])):
            if not ws:
                continue
            port = free_port()
            llama_rows.update(run_server(args, f"llama.cpp {slots} slot(s)", [
                str(llama), "-m", model, "-t", "2", "-tb", "2", "-np", str(slots),
                "-c", str(max(2048, slots * 1024)), "--host", "127.0.0.1", "--port",
                str(port), "--no-webui"], port, model, ws, tmp / f"sizes-llama-{name}.log"))
        rows.append({"model": name, "read GB/s": bw, "step bytes": nbytes,
                     "roofline tok/s": bw * 1e9 / nbytes, "folio": folio, "llama.cpp": llama_rows,
                     "bandwidth after": read_copy_bandwidth(args)["read GB/s"]})
    print(f"\n{meta['date']} | {meta['cpu']} | AVX2 simulated: {args.avx2_sim}")
    print("| file | read GB/s (before, after) | roofline tok/s | one request: Folio | llama.cpp "
          "| Folio / roofline | Folio / llama.cpp | 32 requests: Folio | llama.cpp | ratio "
          "| prefill: Folio | llama.cpp | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(d, k):
        return f"{d[k]:.1f}" if k in d else "-"

    def ratio(a, b, k):
        return f"{a[k] / b[k]:.2f}x" if k in a and k in b else "-"
    for r in rows:
        f, l1 = r["folio"], r["llama.cpp"]
        one = "one request decode tok/s"
        share = f"{f[one] / r['roofline tok/s']:.0%}" if one in f else "-"
        print(f"| {r['model']} | {r['read GB/s']:.1f}, {r['bandwidth after']:.1f} "
              f"| {r['roofline tok/s']:.1f} | {cell(f, one)} | {cell(l1, one)} | {share} "
              f"| {ratio(f, l1, one)} | {cell(f, '32 requests tok/s')} "
              f"| {cell(l1, '32 requests tok/s')} | {ratio(f, l1, '32 requests tok/s')} "
              f"| {cell(f, 'prefill tok/s')} | {cell(l1, 'prefill tok/s')} "
              f"| {ratio(f, l1, 'prefill tok/s')} |")
    if args.save:
        args.save.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
