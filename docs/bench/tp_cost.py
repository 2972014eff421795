"""What tensor parallelism costs on this CPU: decode step time at tp=1 and 3
on the default model (fp32, 8 sequences of ~200 tokens), and the latency of
one gloo all-reduce of a decode step's activations between 2 processes.

    PYTHONPATH=src python docs/bench/tp_cost.py
"""

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from folio import LLM, SamplingParams


def step_ms(tp: int) -> float:
    llm = LLM(dtype="float32", num_kv_blocks=256, max_model_len=2048, tensor_parallel_size=tp)
    engine = llm.engine
    for i in range(8):
        engine.add_request(str(i), {"prompt_token_ids": [1] + [100 + i + j for j in range(200)]},
                           SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(5):                       # prefill and warm-up
        engine.step()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request([str(i) for i in range(8)])
    llm.shutdown()
    return statistics.median(times) * 1000


def _allreduce_worker(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(8, 576)
    for _ in range(20):
        dist.all_reduce(x)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    if rank == 0:
        results.put(statistics.median(times) * 1e6)
    dist.destroy_process_group()


def allreduce_us() -> float:
    port = 29000 + os.getpid() % 1000
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    value = results.get(timeout=120)
    for p in procs:
        p.join()
    return value


if __name__ == "__main__":
    print(f"gloo all-reduce of [8, 576] fp32 between 2 processes: {allreduce_us():.0f} us")
    for tp in (1, 3):          # 9 heads, 3 KV heads: 1 or 3 ranks
        print(f"tp={tp}: decode step (8 sequences) {step_ms(tp):.1f} ms")
