"""`folio bench memory`: how many KV blocks sharing saves, as figures.

Cases: n = 1, 2, 4, 8 parallel samples of one prompt (copy-on-write), beam
search of width 2, 4, 8 (beams fork and drop on shared blocks), and many
requests behind one long shared prefix (prefix caching). For each, the peak
blocks held, the tokens they held then, and the blocks the same sequences
would hold at that moment if nothing were shared (each sequence its own copy).
"""

from __future__ import annotations

import argparse
import random

from folio.core.kv_cache_manager import cdiv
from folio.sampling_params import SamplingParams


def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=int, default=256, help="prompt of the n cases")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=512, help="the shared system prompt")
    p.add_argument("--suffix-len", type=int, default=32, help="each request's own tokens")
    p.add_argument("--num-shared", type=int, default=16, help="requests behind the prefix")
    p.add_argument("--waste-requests", type=int, default=32,
                   help="requests of the waste workload (0: skip it)")
    p.add_argument("--waste-input-len", default="32:384")
    p.add_argument("--waste-output-len", default="32:192")
    p.add_argument("--json", action="store_true")


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


def bench_memory(args, engine) -> dict:
    rng = random.Random(args.seed)
    vocab = engine.config.model.vocab_size
    special = set(engine.tokenizer.all_special_ids)
    ordinary = [t for t in range(vocab) if t not in special]

    def tokens(n):
        return [rng.choice(ordinary) for _ in range(n)]

    cases = []
    for n in (1, 2, 4, 8):
        prompt = tokens(args.prompt_len)      # a fresh prompt: no help from the prefix cache
        params = SamplingParams(n=n, temperature=1.0, seed=args.seed, max_tokens=args.output_len,
                                ignore_eos=True)
        cases.append(run_case(engine, f"parallel-n{n}", [prompt], params))
    from folio.core.beam import BeamSearchParams
    for width in (2, 4, 8):
        beam = BeamSearchParams(beam_width=width, max_tokens=args.output_len, ignore_eos=True)
        cases.append(run_case(engine, f"beam-w{width}", [tokens(args.prompt_len)], beam))
    prefix = tokens(args.prefix_len)
    shared = [prefix + tokens(args.suffix_len) for _ in range(args.num_shared)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm the cache with one request, as a server that has seen the prefix before.
    run_case(engine, "warm", shared[:1], params)
    cases.append(run_case(engine, f"shared-prefix-{args.num_shared}", shared, params))
    result = {"block_size": engine.config.cache.block_size, "num_blocks": engine.num_blocks,
              "prefix_caching": engine.config.cache.enable_prefix_caching, "cases": cases}
    if args.waste_requests:
        result["waste"] = waste_figures(args, engine)
    return result


def waste_figures(args, engine) -> dict:
    """Internal waste of the paged cache on a workload, against two contiguous
    engines' reservations for the same running batch at every step: one slot
    run of max_model_len per request, or of prompt + max_tokens."""
    from folio.bench.datasets import parse_range, random_requests
    sched, bs = engine.scheduler, engine.config.cache.block_size
    requests = random_requests(args.waste_requests, parse_range(args.waste_input_len),
                               parse_range(args.waste_output_len), engine.config.model.vocab_size,
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
        "requests": len(requests), "peak_waste": sched.waste.peak,
        "average_waste": sched.waste.average,
        "contiguous_max_model_len": {"tokens_fraction": stored / max(1, reserved_max),
                                     "requests_at_once": slots // max_len},
        "contiguous_prompt_plus_max_tokens": {"tokens_fraction": stored / max(1, reserved_need),
                                              "requests_at_once": int(slots // mean_need)},
        "paged_requests_at_once": int(slots // (mean_need * (1 + sched.waste.average))),
    }


def print_memory(result: dict) -> None:
    print(f"block size {result['block_size']}, {result['num_blocks']} blocks, prefix caching "
          f"{'on' if result['prefix_caching'] else 'off'}")
    for c in result["cases"]:
        print(f"{c['name']:>20}: peak {c['peak_blocks']} blocks ({c['peak_tokens']} tokens), "
              f"{c['blocks_without_sharing']} without sharing -> {100 * c['saved']:.1f}% saved; "
              f"{c['tokens_computed']} tokens computed")
    w = result.get("waste")
    if w:
        a, b = w["contiguous_max_model_len"], w["contiguous_prompt_plus_max_tokens"]
        print(f"waste over {w['requests']} requests: peak {100 * w['peak_waste']:.2f}%, "
              f"average {100 * w['average_waste']:.2f}% of allocated slots")
        print(f"  contiguous, max_model_len each: {100 * a['tokens_fraction']:.1f}% of KV holds "
              f"tokens, {a['requests_at_once']} requests fit; prompt + max_tokens each: "
              f"{100 * b['tokens_fraction']:.1f}%, {b['requests_at_once']} fit; paged: "
              f"{w['paged_requests_at_once']} fit")
