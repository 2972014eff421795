"""`folio bench host`: what the engine costs the host per step, on a model too
small to matter (issue 50).

A random Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, a 4,096-token
vocabulary, float32, one thread) run through the public `LLM.generate`: a
pure-decode step's cost at each batch size is the difference of two runs,
`max_tokens` M and M + S, divided by S (the prompts' prefill and the start-up
cancel out). Then the same with a stand-in device (StandInDevice): every step
also takes D ms of device time, beside the host, and gives the model's own,
deterministic, tokens. Synchronous steps wait for it every step (a period of
D + host); scheduled one step ahead (--async-scheduling) the host works while
the device does, and the period tends to max(D, host).

This file also runs as a script, `python src/folio/bench/host.py --json`,
against whichever `folio` is on the path (PYTHONPATH=OLD/src: an earlier
checkout, for before/after in one run: docs/bench/host_ab.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

from folio.cli_types import positive_int

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
             max_position_embeddings=2048)
PROMPT_LEN = 4
# --sampling: each request's SamplingParams fields
SAMPLING = {
    "greedy": dict(temperature=0),
    "random": dict(temperature=0.8, top_p=0.95),
    "penalized": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                      frequency_penalty=0.2, presence_penalty=0.1),
}


def _ints(text: str) -> list[int]:
    return [positive_int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = [-1.0]
    if values and min(values) < 0:
        raise argparse.ArgumentTypeError(f"non-negative numbers, comma-separated: {text!r}")
    return values


def add_host_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=_ints, default=[1, 64, 256], metavar="B,B,...",
                   help="concurrent requests of each pure-decode measurement")
    p.add_argument("--delays", type=_floats, default=[2.0, 5.0, 10.0], metavar="D,D,...",
                   help="the stand-in device's time a step in ms, at the largest batch "
                        "('' for none)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda",
                   help="where the model runs (on cuda the stand-in is not needed: "
                        "give --delays '')")
    p.add_argument("--steps", type=positive_int, default=64, metavar="S",
                   help="decode steps each measurement times")
    p.add_argument("--rounds", type=positive_int, default=3, metavar="R",
                   help="measurements of each row: the fastest is kept")
    p.add_argument("--sampling", choices=list(SAMPLING), default="greedy",
                   help="the requests' sampling: greedy; random (temperature 0.8, top-p "
                        "0.95, a seed each); penalized (random, with repetition, frequency "
                        "and presence penalties)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine's --async-scheduling: each step scheduled while the one "
                        "before runs")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def make_model(folder: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from folio.bench.gpu import write_wordlevel_tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=2)).eval()
    model.save_pretrained(folder)
    write_wordlevel_tokenizer(folder, SHAPE["vocab_size"])
    return str(folder)


class StandInDevice:
    """A device whose every step takes D ms beside the host, the tokens still
    the model's own. It also clocks the model's own work (forward and LM head),
    so that the host's share of a step is the step less that.

    Where the runner gives each step an event to wait on (`step_event`), the
    stand-in works as a GPU's stream does: a step queues D ms of device time
    after what is queued already once the runner has handed it over, and the
    step's result waits until that time has passed (asleep: the GIL let go). An older runner has
    no such event: there the forward sleeps D ms itself, which is what a
    synchronous engine waits on a GPU anyway (it reads each step's tokens
    back before it goes on)."""

    def __init__(self, model, runner, stand_in: bool = True):
        """`stand_in=False`: clocks the model only (the runner's own events kept)."""
        self.model, self.runner, self.delay, self.seconds = model, runner, 0.0, 0.0
        self._forward, self._logits = model.forward, model.compute_logits
        self.queued = stand_in and hasattr(runner, "step_event")
        self.ready_at = 0.0          # when the device is done with what it was given

    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._forward(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        if self.delay and not self.queued:
            time.sleep(self.delay)
        return out

    def compute_logits(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._logits(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out

    def step_event(self) -> "_Deadline":
        """The step's D ms queued once the runner has handed it all over."""
        if self.delay:
            self.ready_at = max(time.perf_counter(), self.ready_at) + self.delay
        return _Deadline(self.ready_at)

    def install(self) -> "StandInDevice":
        self.model.forward, self.model.compute_logits = self.forward, self.compute_logits
        if self.queued:
            self.runner.step_event = self.step_event
        return self


class _Deadline:
    """The stand-in's event: done once the device time queued before it passed."""

    def __init__(self, at: float):
        self.at = at

    def synchronize(self) -> None:
        wait = self.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def _runner(llm):
    return llm.engine.executor.runner


def step_cost(llm, device: StandInDevice, batch: int, steps: int, rounds: int,
              sampling: str = "greedy") -> tuple[float, float]:
    """Seconds per pure-decode step at `batch` requests, (T(M + S) - T(M)) / S,
    and of those the model's own (forward and LM head, the stand-in's sleep
    not counted): the fastest of `rounds`."""
    from folio import SamplingParams
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 4000 for j in range(PROMPT_LEN)]}
               for i in range(batch)]

    def timed(max_tokens: int) -> tuple[float, float]:
        params = [SamplingParams(**SAMPLING[sampling], seed=i, max_tokens=max_tokens,
                                 ignore_eos=True) for i in range(batch)]
        gc.collect()
        device.seconds = 0.0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return seconds, device.seconds

    timed(4)                         # warm-up
    base = 4
    # the fastest of each length, then their difference (the minimum of the
    # differences would favour a slow short run)
    longs = min(timed(base + steps) for _ in range(rounds))
    shorts = min(timed(base) for _ in range(rounds))
    return (longs[0] - shorts[0]) / steps, (longs[1] - shorts[1]) / steps


def run(args) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from folio import LLM
    result = {"cpu": _cpu(), "device": args.device, "shape": SHAPE,
              "async_scheduling": args.async_scheduling, "steps": args.steps,
              "sampling": args.sampling,
              "step_ms": {}, "model_ms": {},
              "host_ms": {},
              "stand_in": []}
    with tempfile.TemporaryDirectory(prefix="folio-host-") as tmp:
        folder = make_model(Path(tmp))
        biggest = max(args.batches)
        ahead = dict(async_scheduling=True) if args.async_scheduling else {}
        llm = LLM(folder, dtype="float32", device=args.device, max_num_seqs=biggest,
                  max_num_batched_tokens=max(2048, biggest * PROMPT_LEN),
                  num_kv_blocks=biggest * 8 + 64, **ahead)
        torch.set_num_threads(1)
        device = StandInDevice(_runner(llm).model, _runner(llm), bool(args.delays)).install()
        for b in args.batches:
            step, model = step_cost(llm, device, b, args.steps, args.rounds, args.sampling)
            result["step_ms"][str(b)] = 1e3 * step
            result["model_ms"][str(b)] = 1e3 * model
            result["host_ms"][str(b)] = 1e3 * (step - model)
        host = result["step_ms"][str(biggest)]      # what the device waits on today
        for d in args.delays:
            device.delay = d / 1e3
            period = 1e3 * step_cost(llm, device, biggest, args.steps, args.rounds,
                                     args.sampling)[0]
            result["stand_in"].append({"batch": biggest, "device_ms": d, "period_ms": period,
                                       "of_max": period / max(d, host),
                                       "of_sum": period / (d + host)})
        device.delay = 0.0
        llm.shutdown()
    return result


def _cpu() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    keep = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
            if f in flags]
    return f"{os.cpu_count()} CPUs, {' '.join(keep) or 'flags unknown'}"


def print_host(r: dict) -> None:
    print(f"host cost per pure-decode step ({r['cpu']}; on {r.get('device', 'cpu')}; "
          f"random Llama hidden 64, 2 layers, "
          f"vocab 4096, float32, 1 thread; {r['steps']} steps; "
          f"{r.get('sampling', 'greedy')} sampling"
          f"{'; --async-scheduling' if r['async_scheduling'] else ''})")
    print("| batch | ms per step | of which the model | host ms | host µs per sequence |")
    print("|---:|---:|---:|---:|---:|")
    for b, ms in r["host_ms"].items():
        print(f"| {b} | {r['step_ms'][b]:.2f} | {r['model_ms'][b]:.2f} | {ms:.2f} | "
              f"{1e3 * ms / int(b):.1f} |")
    if r["stand_in"]:
        print("\nstand-in device (the forward sleeps D ms, the GIL let go)")
        print("| batch | D ms | period ms | / max(D, host) | / (D + host) |")
        print("|---:|---:|---:|---:|---:|")
        for s in r["stand_in"]:
            print(f"| {s['batch']} | {s['device_ms']:g} | {s['period_ms']:.2f} | "
                  f"{s['of_max']:.2f} | {s['of_sum']:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_host_args(parser)
    a = parser.parse_args()
    res = run(a)
    print(json.dumps(res)) if a.json else print_host(res)
