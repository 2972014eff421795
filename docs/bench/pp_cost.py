"""What pipeline parallelism costs on this machine (issue 33): the default
model (its Q4_1 codes, fp32 arithmetic) at --pipeline-parallel-size 1 and 2,
in one run, alternating: a decode step of 8 and of 32 sequences (~200-token
prompts), and the output rate of 32 requests (prompts 200, 64 tokens each,
greedy). P=2 is two processes, 1 thread each, stages of 15 layers; P=1 the
engine's own 2 threads. Also the cost of one gloo send of a decode step's
activations between 2 processes, the traffic each micro-batch adds.

    .venv/bin/python docs/bench/pp_cost.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from folio import LLM, SamplingParams


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [1] + [100 + i + j for j in range(200)]} for i in range(n)]


def measure(pp: int) -> dict:
    llm = LLM(dtype="float32", num_kv_blocks=1024, max_model_len=2048,
              activation_quantization="none", pipeline_parallel_size=pp)
    engine, out = llm.engine, {}
    try:
        for batch in (8, 32):
            for i, p in enumerate(prompts(batch)):
                engine.add_request(f"{batch}-{i}", p, SamplingParams(temperature=0,
                                                                    max_tokens=60,
                                                                    ignore_eos=True))
            while engine.scheduler.num_waiting or any(
                    r.num_computed_tokens < len(r.prompt_token_ids)
                    for r in engine.scheduler.requests.values()):
                engine.step()                       # prefill
            times = []
            for _ in range(15):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            engine.abort_request([f"{batch}-{i}" for i in range(batch)])
            out[f"decode_step_ms_{batch}"] = round(statistics.median(times) * 1000, 1)
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts(32), params, use_tqdm=False)
        out["output_tok_s_32"] = round(32 * 64 / (time.perf_counter() - t), 1)
    finally:
        llm.shutdown()
    return out


def _send_worker(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    for rows in (8, 32):
        x = torch.randn(rows, 576)
        times = []
        for _ in range(200):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, dst=1)
                dist.recv(x, src=1)
            else:
                dist.recv(x, src=0)
                dist.send(x, dst=0)
            times.append(time.perf_counter() - t)
        if rank == 0:
            results[rows] = statistics.median(times) / 2 * 1e6   # one way
    dist.destroy_process_group()


def send_us() -> dict:
    from folio.worker.multiproc import free_local_port
    results = mp.Manager().dict()
    mp.spawn(_send_worker, args=(free_local_port(), results), nprocs=2)
    return {f"send_us_{rows}x576": round(v, 1) for rows, v in sorted(results.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        for pp in (1, 2):
            row = {"round": r, "pp": pp, **measure(pp)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps(send_us()))
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith("avx")})
    print(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                      "cpus": os.cpu_count(), "cpu_flags": flags}))


if __name__ == "__main__":
    main()
