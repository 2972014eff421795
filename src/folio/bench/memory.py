"""`folio bench memory`: how many KV blocks sharing saves, as figures.

Cases: n = 1, 2, 4, 8 parallel samples of one prompt (copy-on-write), beam
search of width 2, 4, 8 (beams fork and drop on shared blocks), and many
requests behind one long shared prefix (prefix caching). For each, the peak
blocks held, the tokens they held then, and the blocks the same sequences
would hold at that moment if nothing were shared (each sequence its own copy).
Then the waste workload: paging against contiguous reservations.
Progress goes to stderr, one line per case, so that `--json` stays one object.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from folio.cli_types import length_range, non_negative_int, positive_int
from folio.core.kv_cache_manager import cdiv
from folio.sampling_params import SamplingParams


def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=positive_int, metavar="N", default=256,
                   help="prompt tokens of the parallel-sampling and beam cases")
    p.add_argument("--output-len", type=positive_int, metavar="N", default=64,
                   help="output tokens of every sharing case")
    p.add_argument("--prefix-len", type=positive_int, metavar="N", default=512,
                   help="tokens of the shared prefix (a system prompt) in the shared-prefix case")
    p.add_argument("--suffix-len", type=positive_int, metavar="N", default=32,
                   help="each shared-prefix request's own tokens after the prefix")
    p.add_argument("--num-shared", type=positive_int, metavar="N", default=16,
                   help="requests running together behind the shared prefix")
    p.add_argument("--waste-requests", type=non_negative_int, metavar="N", default=32,
                   help="requests of the waste workload, paging against contiguous "
                        "reservations (0 skips it)")
    p.add_argument("--waste-input-len", type=length_range, metavar="A:B", default="32:384",
                   help="prompt tokens of the waste workload: A:B drawn uniformly, or N")
    p.add_argument("--waste-output-len", type=length_range, metavar="A:B", default="32:192",
                   help="output tokens of the waste workload: A:B drawn uniformly, or N")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (progress still goes to stderr)")


def _progress(total: int):
    """A function to call as each case starts: one line on stderr, so that a
    run of minutes shows where it is."""
    t0, done = time.perf_counter(), [0]

    def start(name: str) -> None:
        done[0] += 1
        print(f"folio bench memory: [{done[0]}/{total}] {name} "
              f"({time.perf_counter() - t0:.0f} s elapsed)", file=sys.stderr, flush=True)
    return start


def _held(engine) -> tuple[int, int]:
    """(tokens held, blocks they would take unshared) by the running requests."""
    bs = engine.config.cache.block_size
    tokens = blocks = 0
    for req in engine.scheduler.running:
        copies = len(req.live_seqs)
        tokens += copies * req.num_computed_tokens
        blocks += copies * cdiv(req.num_computed_tokens, bs)
    return tokens, blocks


def run_case(engine, name: str, prompts: list[list[int]], params) -> dict:
    """`params`: SamplingParams, or BeamSearchParams for a beam search."""
    from folio.core.beam import BeamSearchParams
    pool = engine.scheduler.kv.pool
    for i, ids in enumerate(prompts):
        if isinstance(params, BeamSearchParams):
            engine.add_beam_request(f"{name}-{i}", None, ids, params)
        else:
            engine.add_tokenized_request(f"{name}-{i}", None, ids, params)
    peak = {"name": name, "peak_blocks": 0, "peak_tokens": 0, "blocks_without_sharing": 0}
    before = engine.executor.runner.num_computed_tokens_total
    while engine.has_unfinished_requests():
        engine.step()
        used = pool.num_used_blocks
        if used >= peak["peak_blocks"]:
            tokens, unshared = _held(engine)
            peak.update(peak_blocks=used, peak_tokens=tokens, blocks_without_sharing=unshared)
    peak["tokens_computed"] = engine.executor.runner.num_computed_tokens_total - before
    peak["saved"] = 1 - peak["peak_blocks"] / max(1, peak["blocks_without_sharing"])
    return peak


def _cases(args, engine) -> list[tuple[str, list[list[int]], object]]:
    """(name, prompts, params) of every sharing case, in the order they run."""
    from folio.core.beam import BeamSearchParams
    rng = random.Random(args.seed)
    special = set(engine.tokenizer.all_special_ids)
    ordinary = [t for t in range(engine.config.model.vocab_size) if t not in special]

    def tokens(n):
        return [rng.choice(ordinary) for _ in range(n)]

    cases = []
    for n in (1, 2, 4, 8):
        # A fresh prompt each: no help from the prefix cache.
        cases.append((f"parallel-n{n}", [tokens(args.prompt_len)], SamplingParams(
            n=n, temperature=1.0, seed=args.seed, max_tokens=args.output_len, ignore_eos=True)))
    for width in (2, 4, 8):
        beam = BeamSearchParams(beam_width=width, max_tokens=args.output_len, ignore_eos=True)
        cases.append((f"beam-w{width}", [tokens(args.prompt_len)], beam))
    prefix = tokens(args.prefix_len)
    shared = [prefix + tokens(args.suffix_len) for _ in range(args.num_shared)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm the cache with one request, as a server that has seen the prefix before.
    cases.append(("warm", shared[:1], params))
    cases.append((f"shared-prefix-{args.num_shared}", shared, params))
    return cases


def bench_memory(args, engine) -> dict:
    cases = _cases(args, engine)
    start = _progress(len(cases) + bool(args.waste_requests))
    results = []
    for name, prompts, params in cases:
        start(name)
        case = run_case(engine, name, prompts, params)
        if name != "warm":
            results.append(case)
    result = {"block_size": engine.config.cache.block_size, "num_blocks": engine.num_blocks,
              "prefix_caching": engine.config.cache.enable_prefix_caching, "cases": results,
              "capacity": capacity_by_dtype(engine)}
    if args.waste_requests:
        start(f"waste workload, {args.waste_requests} requests")
        result["waste"] = waste_figures(args, engine)
    return result


def waste_figures(args, engine) -> dict:
    """Internal waste of the paged cache on a workload, against two contiguous
    engines' reservations for the same running batch at every step: one slot
    run of max_model_len per request, or of prompt + max_tokens. With EOS
    ignored, max_tokens is each request's exact output length: the second is
    an oracle that knows every output length in advance, the best a contiguous
    engine could do (a real one only knows max_tokens as an upper bound)."""
    from folio.bench.datasets import random_requests
    sched, bs = engine.scheduler, engine.config.cache.block_size
    requests = random_requests(args.waste_requests, args.waste_input_len, args.waste_output_len,
                               engine.config.model.vocab_size,
                               engine.tokenizer.all_special_ids, args.seed)
    for i, r in enumerate(requests):
        engine.add_tokenized_request(f"waste-{i}", None, r.prompt_token_ids, SamplingParams(
            temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    sched.waste = type(sched.waste)()          # count this workload only
    stored = reserved_max = reserved_need = 0
    max_len = engine.config.max_model_len
    while engine.has_unfinished_requests():
        engine.step()
        running = sched.running
        stored += sum(len(r.live_seqs) * r.num_computed_tokens for r in running)
        reserved_max += len(running) * max_len
        reserved_need += sum(len(r.prompt_token_ids) + r.params.max_tokens for r in running)
    slots = engine.num_blocks * bs
    mean_need = sum(len(r.prompt_token_ids) + r.max_tokens for r in requests) / len(requests)
    return {
        "requests": len(requests), "kv_slots": slots, "max_model_len": max_len,
        "peak_waste": sched.waste.peak, "average_waste": sched.waste.average,
        "paged_tokens_fraction": 1 - sched.waste.average,
        "contiguous_max_model_len": {"tokens_fraction": stored / max(1, reserved_max),
                                     "requests_at_once": slots // max_len},
        "contiguous_prompt_plus_max_tokens": {"tokens_fraction": stored / max(1, reserved_need),
                                              "requests_at_once": int(slots // mean_need)},
        "paged_requests_at_once": int(slots // (mean_need * (1 + sched.waste.average))),
    }


def capacity_by_dtype(engine) -> list[dict]:
    """This engine's cache memory held in each KV cache dtype: blocks, tokens
    and requests of max_model_len at once."""
    from folio.worker.kv_cache import capacity
    runner = engine.executor.runner
    budget = engine.num_blocks * runner.bytes_per_block
    heads = runner.model.num_kv_heads_per_rank
    return [capacity(engine.config, heads, runner.attn_backend, kv, budget)
            for kv in ("float32", "bfloat16", "int8", "fp8")]


def print_memory(result: dict) -> None:
    print(f"block size {result['block_size']}, {result['num_blocks']} blocks, prefix caching "
          f"{'on' if result['prefix_caching'] else 'off'}")
    if result.get("capacity"):
        print("the same cache memory in each --kv-cache-dtype:")
        for c in result["capacity"]:
            print(f"  {c['kv_cache_dtype']:>9}: {c['bytes_per_block']} bytes a block, "
                  f"{c['blocks']} blocks, {c['tokens']} tokens, "
                  f"{c['requests_at_max_model_len']} requests of max_model_len at once")
    for c in result["cases"]:
        print(f"{c['name']:>20}: peak {c['peak_blocks']} blocks ({c['peak_tokens']} tokens), "
              f"{c['blocks_without_sharing']} without sharing -> {100 * c['saved']:.1f}% saved; "
              f"{c['tokens_computed']} tokens computed")
    if result.get("waste"):
        _print_waste(result["waste"], result["block_size"])


def _print_waste(w: dict, block_size: int) -> None:
    a, b = w["contiguous_max_model_len"], w["contiguous_prompt_plus_max_tokens"]
    rows = [(f"paged, blocks of {block_size} allocated as tokens arrive",
             w["paged_requests_at_once"], w["paged_tokens_fraction"]),
            (f"contiguous, max_model_len ({w['max_model_len']}) reserved each",
             a["requests_at_once"], a["tokens_fraction"]),
            ("contiguous oracle, prompt + exact output length reserved",
             b["requests_at_once"], b["tokens_fraction"])]
    print(f"waste workload, {w['requests']} requests submitted at once: the paged cache left "
          f"{100 * w['average_waste']:.2f}% of its allocated slots empty on average, "
          f"{100 * w['peak_waste']:.2f}% at the worst step")
    print(f"  {'KV scheme':<58} {'fit *':>6} {'held tokens **':>15}")
    for label, fit, fraction in rows:
        print(f"  {label:<58} {fit:>6} {100 * fraction:>14.1f}%")
    print(f"  * requests of this workload, each at its full length, that fit at once in "
          f"{w['kv_slots']} KV slots")
    print("  ** share of the KV slots each scheme held for the running requests that held a "
          "token, over the run")
    print("  The oracle knows every output length before the request runs, which no server "
          "does; paging needs no such knowledge.")
