"""`folio bench memory`: how many KV blocks sharing saves, as figures.

Cases: n = 1, 2, 4, 8 parallel samples of one prompt (copy-on-write), and many
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


def run_case(engine, name: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    pool = engine.scheduler.kv.pool
    for i, ids in enumerate(prompts):
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
    prefix = tokens(args.prefix_len)
    shared = [prefix + tokens(args.suffix_len) for _ in range(args.num_shared)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm the cache with one request, as a server that has seen the prefix before.
    run_case(engine, "warm", shared[:1], params)
    cases.append(run_case(engine, f"shared-prefix-{args.num_shared}", shared, params))
    return {"block_size": engine.config.cache.block_size, "num_blocks": engine.num_blocks,
            "prefix_caching": engine.config.cache.enable_prefix_caching, "cases": cases}


def print_memory(result: dict) -> None:
    print(f"block size {result['block_size']}, {result['num_blocks']} blocks, prefix caching "
          f"{'on' if result['prefix_caching'] else 'off'}")
    for c in result["cases"]:
        print(f"{c['name']:>20}: peak {c['peak_blocks']} blocks ({c['peak_tokens']} tokens), "
              f"{c['blocks_without_sharing']} without sharing -> {100 * c['saved']:.1f}% saved; "
              f"{c['tokens_computed']} tokens computed")
