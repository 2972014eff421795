"""`folio bench gpu` (benchmarks/gpu.sh): the GPU path measured in one run.

On one GPU, with no network, from the source tree: a random-weight model of
Llama-3-8B's shapes in bf16 is made on the GPU and written as a Hugging Face
folder (safetensors, a word-level tokenizer of its vocabulary), then, the
headline figures first, each written to its own JSON file in `--out` the
moment it is measured (a run cut off by its time limit keeps them):

0. `decode_attention.json` (before the model is made): the Triton decode
   kernel alone at batch 200 of 800-token contexts on the 8B's heads, for
   each of its configurations (keys a tile, warps, stages): the KV bytes it
   reads over its time as a fraction of the copy bandwidth;
1. `batch1.json`: one request of 256 prompt and 256 output tokens (16 with
   --tiny); ms per output token, and the weight bytes each decode step reads
   over that time as a fraction of the card's bandwidth, measured by a copy;
2. `throughput.json`: offline throughput on `--num-prompts` requests (default
   200; prompt 256-1,024, output 128-512, random ids, EOS ignored), output
   tokens/s; with `steps.jsonl`, a record of every step of that run (batch,
   tokens, decodes, context, wall ms) and its summary by kind of step;
3. `served.json`: `folio serve` on the same folder driven by `folio bench
   serve`, `--served-streams` (64) streams at once: output tok/s, TTFT and ITL;
4. with --profile, `profile.txt`: decode steps under torch.profiler at batch
   1 and at a full batch (200) of ~800-token contexts, and one mixed step
   (those decodes and a prompt chunk): wall time per step against kernel
   time, the costliest kernels;
4b. `fp8.json` (unless --no-fp8): the same model under `--quantization fp8`
   (e4m3 weights, a scale per output feature; fp8 products with dynamic
   per-token activations where the card has them, compute capability 8.9
   and up): batch-1 decode and the throughput run on the same requests, and
   each as a ratio to bf16's above (issue 54's goals: 1.7x and 1.4x);
5. `logprobs`: teacher-forced logprobs of the prompt tokens through the
   TRITON backend against the torch backend, max and mean |difference| (bf16
   greedy tokens of random 8B weights part at the first rounding difference,
   so token equality there proves nothing); on a GPU also greedy tokens of
   the two in fp32 on tiny shapes, which must agree;
6. transformers `generate` in static batches on the same weights
   (`--hf-limit` requests), and peak memory against the
   --gpu-memory-utilization budget.

It writes result.json and result.md at the end, and result.partial.json
after each step. `--tiny` runs the same steps on tiny shapes in seconds;
without a GPU it runs on the CPU with the kernels in triton's interpreter, so
that the script is known to run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from folio.cli_types import positive_int

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
            rope_theta=10000.0)


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes and few requests: a dry run in seconds (on the CPU "
                        "without a GPU, kernels in triton's interpreter)")
    p.add_argument("--out", type=Path, metavar="DIR", default=Path("bench-gpu"),
                   help="where result.json and result.md are written")
    p.add_argument("--work", type=Path, metavar="DIR", default=None,
                   help="where the random model folder is written (default: a temporary "
                        "folder, removed after)")
    p.add_argument("--num-prompts", type=positive_int, metavar="N", default=None,
                   help="requests of the throughput workload (default 200; 4 with --tiny)")
    p.add_argument("--served-streams", type=positive_int, metavar="N", default=None,
                   help="concurrent streams of the served run (default 64; 4 with --tiny)")
    p.add_argument("--hf-limit", type=positive_int, metavar="K", default=None,
                   help="requests the transformers baseline runs (default 64; 2 with --tiny)")
    p.add_argument("--hf-batch", type=positive_int, metavar="B", default=16,
                   help="static batch size of the transformers baseline")
    p.add_argument("--no-fp8", action="store_true",
                   help="skip the fp8 run (--quantization fp8 beside bf16)")
    p.add_argument("--profile", action="store_true",
                   help="also profile decode steps at batch 1 and at a full batch of "
                        "~800-token contexts, and one mixed step (torch.profiler: host "
                        "time per step against kernel time, the costliest kernels) into "
                        "profile.txt")


def make_model(folder: Path, shape: dict, dtype, device: str, seed: int = 0):
    """A random Llama of `shape`, made on `device`, written to `folder`; the
    transformers model is returned (moved to the CPU) for the baseline."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    write_wordlevel_tokenizer(folder, shape["vocab_size"])
    return model.to("cpu")


def write_wordlevel_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer whose every id is a word `t<id>`: the benchmark sends ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
         "unk_token": "t0"}))


def memory_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, bytes read and written counted."""
    import torch
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - t0)


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    import torch
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _prompts(vocab: int, lengths, seed: int = 1) -> list[dict]:
    import random
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]


def _dry_run_kv(device: str) -> Optional[str]:
    """The KV budget on the CPU, where only the dry run (--tiny) runs: its tiny
    model needs little, and the 2 GiB default costs over a second to zero an
    engine. None on CUDA (each engine's own sizing)."""
    return None if device.startswith("cuda") else "64MiB"


def _llm(folder: Path, dtype: str, device: str, name: str):
    from folio import LLM
    return LLM(str(folder), dtype=dtype, device=device, attention_backend=name,
               kv_cache_memory_bytes=_dry_run_kv(device) or "2GiB", max_model_len=1024,
               enforce_eager=True)


def correctness(folder: Path, dtype: str, device: str, vocab: int, lengths,
                max_tokens: int) -> dict:
    """Greedy tokens of TRITON and TORCH_SDPA on the same prompts."""
    from folio import SamplingParams
    prompts = _prompts(vocab, lengths)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = {}
    for name in ("TRITON", "TORCH_SDPA"):
        llm = _llm(folder, dtype, device, name)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
        llm.shutdown()
        del llm
        _free(device)
    pairs = [(a, b) for ta, tb in zip(runs["TRITON"], runs["TORCH_SDPA"])
             for a, b in zip(ta, tb)]
    first = [next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
             for ta, tb in zip(runs["TRITON"], runs["TORCH_SDPA"])]
    return {"tokens": len(pairs), "agree": sum(a == b for a, b in pairs),
            "first_difference": first}


def teacher_forced(folder: Path, dtype: str, device: str, vocab: int, lengths) -> dict:
    """The logprob of every prompt token given the ones before it (prompt
    logprobs), through TRITON and through TORCH_SDPA: the largest and the mean
    |difference| over all positions."""
    from folio import SamplingParams
    prompts = _prompts(vocab, lengths, seed=2)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for name in ("TRITON", "TORCH_SDPA"):
        llm = _llm(folder, dtype, device, name)
        runs[name] = [[d[t] for d, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
                      for o, p in zip(llm.generate(prompts, params, use_tqdm=False), prompts)]
        llm.shutdown()
        del llm
        _free(device)
    diffs = [abs(a - b) for ra, rb in zip(runs["TRITON"], runs["TORCH_SDPA"])
             for a, b in zip(ra, rb)]
    return {"positions": len(diffs), "max_abs_diff": max(diffs),
            "mean_abs_diff": sum(diffs) / len(diffs),
            "mean_logprob": sum(sum(r) for r in runs["TORCH_SDPA"]) / len(diffs)}


def decode_attention(device: str, bandwidth: float, tiny: bool) -> dict:
    """The Triton decode kernel alone at a serving batch: `batch` sequences of
    `context` keys (Llama-3-8B's 32 query and 8 KV heads of 128, bf16, pages
    of 16, random tables), timed over repeated launches for each (keys a
    tile, warps, pipeline stages); the bytes of keys and values it reads a
    launch over its time, as a fraction of the copy bandwidth. The default
    configuration is the backend's (TritonAttentionBackend.block_n, 4 warps,
    2 stages)."""
    import torch

    from folio.kernels import triton_attention as tk
    from folio.model.attention.triton_backend import TritonAttentionBackend, split_plan
    cuda = device == "cuda"
    batch, context, heads, kv_heads, d, bs = ((4, 40, 4, 2, 64, 16) if tiny
                                              else (200, 800, 32, 8, 128, 16))
    dtype = torch.bfloat16 if cuda else torch.float32
    per_seq = -(-context // bs)
    blocks = batch * per_seq + 1
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g, device=device).to(dtype)
    tables = torch.randperm(blocks - 1, generator=g, device=device)[:batch * per_seq] \
        .view(batch, per_seq) + 1
    ctx = torch.full((batch,), context, dtype=torch.int64, device=device)
    q = torch.randn(batch, heads, d, generator=g, device=device).to(dtype)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * kv_heads * d * cache.element_size()
    target = (2 * torch.cuda.get_device_properties(0).multi_processor_count if cuda else 1)
    # 12 settings: each compiles once (about a second on a card), so the sweep
    # stays within seconds of the run's budget
    configs = ([(TritonAttentionBackend.block_n, 4, 2)] if tiny else
               [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)])
    rows = []
    for block_n, warps, stages in configs:
        splits, per = split_plan(batch, kv_heads, context, target,
                                 TritonAttentionBackend.min_split_tokens, block_n)

        def launch():
            tk.paged_decode(q, cache[0], cache[1], tables, ctx, d ** -0.5, out, splits, per,
                            block_n, dot_fp32=not cuda, stages=stages, num_warps=warps)
        try:
            launch()
        except Exception as e:         # a configuration the compiler refuses (resources)
            rows.append({"block_n": block_n, "warps": warps, "stages": stages,
                         "error": str(e).splitlines()[0][:200]})
            continue
        _sync(device)
        reps = 2 if tiny else 50
        t0 = time.perf_counter()
        for _ in range(reps):
            launch()
        _sync(device)
        seconds = (time.perf_counter() - t0) / reps
        rows.append({"block_n": block_n, "warps": warps, "stages": stages, "splits": splits,
                     "us": seconds * 1e6, "bandwidth_fraction": kv_bytes / seconds / bandwidth})
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    default = next(r for r in timed if (r["block_n"], r["warps"], r["stages"])
                   == (TritonAttentionBackend.block_n, 4, 2))
    return {"device": _device_name(device), "batch": batch, "context": context,
            "heads": heads, "kv_heads": kv_heads, "head_dim": d, "block_size": bs,
            "kv_bytes": kv_bytes, "default": default, "best": best, "configs": rows}


def _weight_bytes(engine) -> int:
    model = engine.executor.runner.model
    return sum(t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers()))


def batch1_decode(engine, vocab: int, bandwidth: float, length: int) -> dict:
    """One request, `length` prompt + `length` output tokens; decode ms per
    token from the time after the first token."""
    from folio import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    engine.add_tokenized_request("b1", None, [(7 * i) % (vocab - 3) + 3 for i in range(length)],
                                 params)
    t0 = time.perf_counter()
    first, n = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if first is None and n:
                first = time.perf_counter()
    end = time.perf_counter()
    ms = (end - first) / (n - 1) * 1e3
    read = _weight_bytes(engine)          # every weight is read once per decode step
    return {"ttft_s": first - t0, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
            "weight_bytes": read, "bandwidth_fraction": read / (ms / 1e3) / bandwidth}


def profile_decode(engine, vocab: int, out_dir: Path, device: str, batches=(1, 200),
                   prompt: int = 800, steps: int = 12, chunk: int = 512) -> dict:
    """Decode steps under torch.profiler at each batch size, `prompt`-token
    contexts, then one mixed step at the last batch (its decodes and a
    `chunk`-token prompt): wall ms per step against the kernels' ms (the
    difference is the host's share that the device waits on), and the
    costliest kernels, into out_dir/profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    from folio import SamplingParams
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.startswith("cuda") else [])
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    prompt = min(prompt, engine.config.max_model_len - steps - 16)
    report, lines = {}, []

    def measure(name: str, n: int) -> None:
        _sync(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                engine.step()
            _sync(device)
            wall = (time.perf_counter() - t0) / n * 1e3
        events = prof.key_averages()
        kernel_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
        report[name] = {"wall_ms_per_step": wall, "kernel_ms_per_step": kernel_us / 1e3 / n}
        sort = "self_device_time_total" if len(activities) > 1 else "self_cpu_time_total"
        lines.extend([f"== {name.replace('batch', 'decode at batch ')}: {wall:.2f} ms per "
                      f"step wall, {kernel_us / 1e3 / n:.2f} ms of kernels", "",
                      events.table(sort_by=sort, row_limit=18, max_name_column_width=60), "",
                      events.table(sort_by="self_cpu_time_total", row_limit=12,
                                   max_name_column_width=60), ""])

    for batch in batches:
        for i in range(batch):
            engine.add_tokenized_request(f"prof{batch}-{i}", None,
                                         [(11 * i + 3 * j) % (vocab - 3) + 3
                                          for j in range(prompt)], params)
        while engine.scheduler.num_waiting or any(      # every prompt in, decodes warm
                r.num_computed_tokens < prompt for r in engine.scheduler.running):
            engine.step()
        for _ in range(2):
            engine.step()
        measure(f"batch{batch}", steps)
        if batch == batches[-1]:
            engine.add_tokenized_request("prof-mixed", None, [(5 * j) % (vocab - 3) + 3
                                                              for j in range(chunk)], params)
            measure("mixed", 1)
        while engine.has_unfinished_requests():
            engine.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile.txt").write_text("\n".join(lines))
    return report


class StepRecord:
    """Every step of an engine run, taken where the engine schedules it:
    sequences, tokens, decodes, context (keys in the cache after the step,
    summed), and wall ms (this schedule to the next: the step's whole period)."""

    def __init__(self, engine):
        self.rows: list[dict] = []
        self._sched = engine.scheduler
        real = self._sched.schedule
        self._t = 0.0

        def schedule(*a, **kw):
            out = real(*a, **kw)
            self._close()
            seqs = out.seqs
            if seqs:
                tokens = sum(len(q.token_ids) for q in seqs)
                self.rows.append({"batch": len(seqs), "tokens": tokens,
                                  "decodes": sum(len(q.token_ids) == 1 for q in seqs),
                                  "context": sum(q.start_pos + len(q.token_ids) for q in seqs)})
            return out
        self._sched.schedule = schedule

    def _close(self) -> None:
        now = time.perf_counter()
        if self.rows and "ms" not in self.rows[-1]:
            self.rows[-1]["ms"] = (now - self._t) * 1e3
        self._t = now

    def stop(self) -> dict:
        """Undo the hook; a summary by kind of step: "decode" (one token a
        sequence), "prefill" (any prompt tokens: prefill or mixed)."""
        self._close()
        del self._sched.schedule
        summary = {}
        for kind, rows in (("decode", [r for r in self.rows if r["tokens"] == r["batch"]]),
                           ("prefill", [r for r in self.rows if r["tokens"] > r["batch"]])):
            if rows:
                ms = sum(r.get("ms", 0.0) for r in rows)
                summary[kind] = {"steps": len(rows), "seconds": ms / 1e3,
                                 "mean_ms": ms / len(rows),
                                 "mean_batch": sum(r["batch"] for r in rows) / len(rows),
                                 "mean_tokens": sum(r["tokens"] for r in rows) / len(rows),
                                 "mean_context_per_seq": sum(r["context"] for r in rows)
                                 / sum(r["batch"] for r in rows)}
        return summary


def _cpu_name() -> str:
    from folio.env_report import cpu_info
    model, flags = cpu_info()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return f"CPU {model} ({' '.join(f for f in wanted if f in flags)})"


def _headline(args, name: str, data: dict) -> None:
    """A headline figure into its own file the moment it is measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))


def run(args) -> dict:
    import torch
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else LLAMA3_8B
    dtype_name = "bfloat16" if cuda else "float32"
    dtype = getattr(torch, dtype_name)
    n_prompts = args.num_prompts or (4 if args.tiny else 200)
    hf_limit = args.hf_limit or (2 if args.tiny else 16)
    lens = ((8, 40), (4, 12)) if args.tiny else ((256, 1024), (128, 512))
    result: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "device": torch.cuda.get_device_name() if cuda else _cpu_name(),
        "torch": torch.__version__, "dtype": dtype_name, "tiny": args.tiny,
        "shape": shape, "requests": n_prompts}
    steps: dict = {}
    result["steps"] = steps

    def save(more: Optional[dict] = None) -> None:
        """What is measured so far, into result.partial.json: a run cut short
        by its time limit keeps its finished steps."""
        args.out.mkdir(parents=True, exist_ok=True)
        partial = {k: v for k, v in {**result, **(more or {})}.items() if not k.startswith("_")}
        (args.out / "result.partial.json").write_text(json.dumps(partial, indent=1))

    bandwidth = memory_bandwidth(device, 1 << (32 if cuda else 26))
    result["copy_bandwidth_bytes_per_s"] = bandwidth
    # the decode kernel alone, its configurations swept (seconds, before the model)
    t = time.perf_counter()
    result["decode_attention"] = decode_attention(device, bandwidth, args.tiny)
    steps["decode_attention_s"] = time.perf_counter() - t
    _headline(args, "decode_attention", result["decode_attention"])
    save()
    _free(device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.work or tmp) / "model"
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        hf_model = make_model(folder, shape, dtype, device)
        steps["make_model_s"] = time.perf_counter() - t
        # the headline figures first, each in its file as soon as it is done
        result.update(_engine_runs(args, folder, dtype_name, device, shape, n_prompts, lens,
                                   bandwidth, steps, save))
        save()
        _free(device)
        t = time.perf_counter()
        result["served"] = served(args, folder, dtype_name, device, lens)
        steps["served_s"] = time.perf_counter() - t
        _headline(args, "served", result["served"])
        save()
        if not args.no_fp8:
            t = time.perf_counter()
            result["fp8"] = fp8_runs(args, folder, dtype_name, device, shape, lens, bandwidth,
                                     result)
            steps["fp8_s"] = time.perf_counter() - t
            _headline(args, "fp8", {"device": _device_name(device), **result["fp8"]})
            save()
            _free(device)
        t = time.perf_counter()
        result["logprobs"] = teacher_forced(folder, dtype_name, device, shape["vocab_size"],
                                            (12, 40) if args.tiny else (64, 300, 700))
        steps["logprobs_s"] = time.perf_counter() - t
        save()
        # greedy tokens must agree where the arithmetic is fp32 (no TF32 either side):
        # the tiny run's own model on the CPU, a tiny fp32 one on a GPU
        t = time.perf_counter()
        if cuda:
            tiny = Path(args.work or tmp) / "tiny-fp32"
            tiny.mkdir(parents=True, exist_ok=True)
            make_model(tiny, TINY, torch.float32, device)
        else:
            tiny = folder
        result["correctness"] = correctness(tiny, "float32", device, TINY["vocab_size"],
                                            (5, 20, 40) if args.tiny else (5, 20, 40, 300),
                                            8 if args.tiny else 32)
        steps["correctness_s"] = time.perf_counter() - t
        save()
        t = time.perf_counter()
        result["transformers"] = _hf_run(hf_model.to(device), result["_requests"][:hf_limit],
                                         args.hf_batch)
        steps["transformers_s"] = time.perf_counter() - t
    del result["_requests"]
    result["speedup_over_transformers"] = (result["throughput"]["output_tokens_per_s"]
                                           / result["transformers"]["output_tokens_per_s"])
    return result


def _engine_runs(args, folder, dtype_name, device, shape, n_prompts, lens, bandwidth,
                 steps, save) -> dict:
    import torch

    from folio.bench.datasets import random_requests
    from folio.bench.throughput import run_engine
    from folio.engine.llm_engine import LLMEngine
    b1 = 16 if args.tiny else 256
    t = time.perf_counter()
    engine = LLMEngine.from_args(str(folder), dtype=dtype_name, device=device,
                                 attention_backend="TRITON",
                                 max_model_len=max(lens[0][1] + lens[1][1], 2 * b1) + 16,
                                 kv_cache_memory_bytes=_dry_run_kv(device))
    steps["engine_start_s"] = time.perf_counter() - t
    out: dict = {}
    runner = engine.executor.runner
    out["kv_blocks"] = runner.num_blocks
    out["cuda_graphs"] = runner.graphs.sizes if runner.graphs is not None else None
    t = time.perf_counter()
    out["batch1"] = batch1_decode(engine, shape["vocab_size"], bandwidth, b1)
    steps["batch1_s"] = time.perf_counter() - t
    _headline(args, "batch1", {"device": _device_name(device), **out["batch1"]})
    save(out)
    requests = random_requests(n_prompts, lens[0], lens[1], shape["vocab_size"], [0, 1, 2], 0)
    engine.reset_prefix_cache()
    record = StepRecord(engine)
    t = time.perf_counter()
    produced, seconds = run_engine(engine, requests, True, "continuous", 0)
    steps["throughput_s"] = time.perf_counter() - t
    out["throughput"] = {"requests": len(requests), "output_tokens": sum(produced),
                         "seconds": seconds, "output_tokens_per_s": sum(produced) / seconds,
                         "by_step": record.stop()}
    _headline(args, "throughput", {"device": _device_name(device), **out["throughput"]})
    with open(args.out / "steps.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in record.rows)
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        util = engine.config.cache.gpu_memory_utilization
        out["memory"] = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                         "in_use_bytes": total - free, "budget_bytes": int(total * util),
                         "total_bytes": total}
    save(out)
    if getattr(args, "profile", False):
        t = time.perf_counter()
        out["profile"] = profile_decode(
            engine, shape["vocab_size"], args.out, device,
            batches=(1, 4) if args.tiny else (1, 200), prompt=16 if args.tiny else 800,
            steps=3 if args.tiny else 12, chunk=24 if args.tiny else 512)
        steps["profile_s"] = time.perf_counter() - t
        save(out)
    engine.shutdown()
    del engine, runner
    out["_requests"] = requests
    return out


def fp8_runs(args, folder: Path, dtype_name: str, device: str, shape: dict, lens,
             bandwidth: float, bf16: dict) -> dict:
    """The model under --quantization fp8: batch-1 decode and the throughput
    run on the bf16 run's requests, and their ratios to bf16's."""
    from folio.bench.throughput import run_engine
    from folio.bench.weights import loaded_bytes
    from folio.engine.llm_engine import LLMEngine
    from folio.model.layers.quantization.fp8 import Fp8Linear
    b1 = 16 if args.tiny else 256
    t = time.perf_counter()
    engine = LLMEngine.from_args(str(folder), dtype=dtype_name, device=device,
                                 attention_backend="TRITON", quantization="fp8",
                                 max_model_len=max(lens[0][1] + lens[1][1], 2 * b1) + 16,
                                 kv_cache_memory_bytes=_dry_run_kv(device))
    start = time.perf_counter() - t
    model = engine.executor.runner.model
    method = model.model.layers[0].self_attn.qkv_proj.quant_method
    if not isinstance(method, Fp8Linear):
        raise RuntimeError(f"--quantization fp8 left layer 0's qkv_proj as {method!r}")
    out: dict = {"engine_start_s": start, "fp8_products": method.products,
                 "weight_bytes": loaded_bytes(model)["bytes"]["total"]}
    b = batch1_decode(engine, shape["vocab_size"], bandwidth, b1)
    # the codes are not parameters: the bytes a step reads, from the packed forms
    b["weight_bytes"] = out["weight_bytes"]
    b["bandwidth_fraction"] = b["weight_bytes"] / (b["ms_per_token"] / 1e3) / bandwidth
    out["batch1"] = b
    requests = bf16["_requests"]
    engine.reset_prefix_cache()
    produced, seconds = run_engine(engine, requests, True, "continuous", 0)
    out["throughput"] = {"requests": len(requests), "output_tokens": sum(produced),
                         "seconds": seconds, "output_tokens_per_s": sum(produced) / seconds}
    out["batch1_vs_bf16"] = b["tokens_per_s"] / bf16["batch1"]["tokens_per_s"]
    out["throughput_vs_bf16"] = (out["throughput"]["output_tokens_per_s"]
                                 / bf16["throughput"]["output_tokens_per_s"])
    engine.shutdown()
    return out


def _device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name() if device == "cuda" else _cpu_name()


def served(args, folder: Path, dtype_name: str, device: str, lens) -> dict:
    """`folio serve` on the folder (TRITON), `folio bench serve` with
    `--served-streams` streams at once: its summary (output tok/s, TTFT, ITL)."""
    import subprocess
    import sys
    import urllib.request

    from folio.worker.multiproc import free_local_port
    streams = args.served_streams or (4 if args.tiny else 64)
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-c", "from folio.cli import main; raise SystemExit(main())"]
    serve = cli + ["serve", str(folder), "--port", str(port), "--dtype", dtype_name,
                   "--device", device, "--attention-backend", "TRITON",
                   "--max-model-len", str(lens[0][1] + lens[1][1] + 16)]
    if _dry_run_kv(device):
        serve += ["--kv-cache-memory-bytes", _dry_run_kv(device)]
    log = open(args.out / "served.log", "w")
    proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"folio serve did not come up: see {args.out / 'served.log'}")
            time.sleep(1)
        bench = cli + ["bench", "serve", "--base-url", url, "--tokenizer", str(folder),
                       "--json", "--seed", "0", "--num-prompts", str(streams),
                       "--max-concurrency", str(streams),
                       "--input-len", f"{lens[0][0]}:{lens[0][1]}",
                       "--output-len", f"{lens[1][0]}:{lens[1][1]}"]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=600)
        if done.returncode or not done.stdout.strip():
            raise RuntimeError(f"folio bench serve failed: {done.stderr[-2000:]}")
        run_ = json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]
        return {"device": _device_name(device), "streams": streams,
                **{k: run_[k] for k in ("completed", "failed", "seconds", "output_throughput",
                                        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _hf_run(model, requests, batch: int) -> dict:
    from folio.bench.baselines import run_hf_static
    model.generation_config.eos_token_id = None
    tokens, seconds = run_hf_static(model, requests, batch)
    return {"requests": len(requests), "batch": batch, "output_tokens": tokens,
            "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def markdown(r: dict) -> str:
    b, t, sv, lp = r["batch1"], r["throughput"], r["served"], r["logprobs"]
    c, h = r["correctness"], r["transformers"]
    rows = [
        ("device", r["device"]), ("torch", r["torch"]), ("dtype", r["dtype"]),
        ("model", "tiny" if r["tiny"] else "Llama-3-8B shapes, random weights"),
        ("copy bandwidth", f"{r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"),
        ("batch-1 decode", f"{b['ms_per_token']:.2f} ms/token, {b['tokens_per_s']:.0f} tok/s, "
                           f"{100 * b['bandwidth_fraction']:.0f}% of the copy bandwidth"),
        ("throughput", f"{t['output_tokens_per_s']:.0f} output tok/s on {t['requests']} "
                       f"requests"),
    ]
    da = r["decode_attention"]
    for which in ("default", "best"):
        k = da[which]
        rows.insert(6 if which == "default" else 7, (
            f"decode attention alone, {which} (batch {da['batch']}, context {da['context']})",
            f"{k['us']:.0f} us, {100 * k['bandwidth_fraction']:.0f}% of the copy bandwidth "
            f"(keys a tile {k['block_n']}, {k['warps']} warps, {k['stages']} stages, "
            f"{k['splits']} splits)"))
    for kind, k in t.get("by_step", {}).items():
        rows.append((f"throughput run, {'decode' if kind == 'decode' else 'prompt'} steps",
                     f"{k['steps']} steps, {k['seconds']:.1f} s, {k['mean_ms']:.2f} ms mean, "
                     f"batch {k['mean_batch']:.0f}, {k['mean_tokens']:.0f} tokens, context "
                     f"{k['mean_context_per_seq']:.0f} a sequence"))
    rows += [
        ("served", f"{sv['streams']} streams: {sv['output_throughput']:.0f} output tok/s, "
                   f"TTFT median {sv['ttft_ms']['median']:.0f} ms (p99 "
                   f"{sv['ttft_ms']['p99']:.0f}), ITL median {sv['itl_ms']['median']:.1f} ms "
                   f"(p99 {sv['itl_ms']['p99']:.1f}), {sv['failed']} failed"),
        ("teacher-forced logprobs, TRITON against the torch backend",
         f"max |d| {lp['max_abs_diff']:.2e}, mean {lp['mean_abs_diff']:.2e} over "
         f"{lp['positions']} positions"),
        ("greedy tokens in fp32 (tiny shapes), TRITON = torch backend",
         f"{c['agree']} of {c['tokens']} (first differences at {c['first_difference']})"),
        ("transformers static", f"{h['output_tokens_per_s']:.0f} output tok/s on "
                                f"{h['requests']} requests, batch {h['batch']}"),
        ("speedup", f"{r['speedup_over_transformers']:.2f}x"),
        ("KV blocks; CUDA graphs", f"{r['kv_blocks']}; {r['cuda_graphs']}"),
    ]
    if "fp8" in r:
        f = r["fp8"]
        rows.append(("fp8 (-q fp8), batch-1 decode",
                     f"{f['batch1']['tokens_per_s']:.0f} tok/s, {f['batch1_vs_bf16']:.2f}x bf16, "
                     f"{100 * f['batch1']['bandwidth_fraction']:.0f}% of the copy bandwidth "
                     f"({'fp8 products' if f['fp8_products'] else 'weight-only'})"))
        rows.append(("fp8 (-q fp8), throughput",
                     f"{f['throughput']['output_tokens_per_s']:.0f} output tok/s on "
                     f"{f['throughput']['requests']} requests, {f['throughput_vs_bf16']:.2f}x "
                     "bf16"))
    for name, p in r.get("profile", {}).items():
        rows.append((f"{name.replace('batch', 'decode step at batch ')}"
                     f"{' step' if name == 'mixed' else ''}",
                     f"{p['wall_ms_per_step']:.2f} ms wall, "
                     f"{p['kernel_ms_per_step']:.2f} ms of kernels"))
    if "memory" in r:
        m = r["memory"]
        rows.append(("peak memory / budget", f"{m['peak_allocated_bytes'] / 2**30:.1f} GiB / "
                                             f"{m['budget_bytes'] / 2**30:.1f} GiB"))
    lines = [f"{r['date']}", "", "| what | measured |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def bench_gpu(args) -> dict:
    import torch
    if not torch.cuda.is_available():
        if not args.tiny:
            raise ValueError("folio bench gpu needs a CUDA device (or --tiny for a dry run "
                             "on the CPU)")
        # triton reads this as it defines its kernels: before they are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    (args.out / "result.md").write_text(markdown(result))
    return result
