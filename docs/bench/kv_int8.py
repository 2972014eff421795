"""The 8-bit KV caches (issue 32: int8 and fp8 e4m3) on the
default model, offline (`LLM`), in one run, configurations alternating
within each round:

- capacity: the blocks, tokens and requests of max_model_len that a fixed
  --kv-cache-memory-bytes holds in each cache dtype (computed by the engine's
  own sizing, scales counted);
- the standard workload (32 requests at once, prompts 32-384 and outputs
  32-192 random ids, greedy, EOS ignored): output tok/s with each cache;
- one request at a long context (a 3072-token prompt, 128 tokens out), where
  decode attention reads the most cache bytes a token;
- drift: teacher-forced logprobs of a public-domain passage with the 8-bit
  cache against the float cache (fp32 arithmetic on the codes): mean and
  largest |difference| per token, and the perplexity of each.

    .venv/bin/python docs/bench/kv_int8.py [--rounds 2] [--memory 1GiB]
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

# Jane Austen, Pride and Prejudice (1813), chapters 1 and 2: public domain
PASSAGE = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, "
    "\"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had "
    "not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me "
    "all about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" "
    "cried his wife impatiently. \"You want to tell me, and I have no objection to hearing "
    "it.\" This was invitation enough. \"Why, my dear, you must know, Mrs. Long says that "
    "Netherfield is taken by a young man of large fortune from the north of England; that "
    "he came down on Monday in a chaise and four to see the place, and was so much "
    "delighted with it, that he agreed with Mr. Morris immediately; that he is to take "
    "possession before Michaelmas, and some of his servants are to be in the house by the "
    "end of next week.\"")


def throughput(requests, **engine) -> float:
    from folio import LLM, SamplingParams
    llm = LLM(max_model_len=4096, **engine)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests[:2]],
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                        [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
                         for r in requests], use_tqdm=False)
    seconds = time.perf_counter() - t0
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def long_context(prompt, **engine) -> float:
    """Decode tok/s of one request after its long prompt: with the prompt in
    the prefix cache, the time of 129 output tokens less that of one."""
    from folio import LLM, SamplingParams
    llm = LLM(max_model_len=4096, **engine)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0
    timed(1)                                            # its prompt cached
    one, many = timed(1), timed(129)
    llm.shutdown()
    return 128 / (many - one)


def drift() -> dict:
    import torch

    from folio import LLM, SamplingParams

    def logprobs(kv):
        llm = LLM(dtype="float32", num_kv_blocks=128, max_model_len=2048,
                  activation_quantization="none", kv_cache_dtype=kv)
        ids = llm.get_tokenizer().encode(PASSAGE)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1,
                                                                     prompt_logprobs=0),
                           use_tqdm=False)[0]
        return torch.tensor([e[t] for e, t in zip(out.prompt_logprobs[1:], ids[1:])])
    exact = logprobs("float32")
    out = {"tokens": len(exact) + 1, "ppl_float": torch.exp(-exact.mean()).item()}
    for kind in ("int8", "fp8"):
        got = logprobs(kind)
        diff = (got - exact).abs()
        out[kind] = {"mean_abs": diff.mean().item(), "max_abs": diff.max().item(),
                     "ppl": torch.exp(-got.mean()).item()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--memory", default="1GiB")
    args = p.parse_args()
    from folio import LLM
    from folio.bench.datasets import random_requests
    from folio.bench.memory import capacity_by_dtype
    from folio.config import parse_size
    from folio.env_report import cpu_info
    from folio.model.loader import load_model_config
    model, flags = cpu_info()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    print(f"{datetime.now(timezone.utc).isoformat(timespec='minutes')} | {model}; flags: "
          f"{' '.join(f for f in wanted if f in flags)}")
    llm = LLM(max_model_len=4096, kv_cache_memory_bytes=args.memory)
    print(f"\ncapacity of --kv-cache-memory-bytes {args.memory} "
          f"({parse_size(args.memory)} bytes), max_model_len 4096:")
    print("| KV cache dtype | bytes a block | blocks | tokens | requests of 4096 at once |")
    print("|---|---|---|---|---|")
    for c in capacity_by_dtype(llm.engine):
        print(f"| {c['kv_cache_dtype']} | {c['bytes_per_block']} | {c['blocks']} | "
              f"{c['tokens']} | {c['requests_at_max_model_len']} |")
    llm.shutdown()
    cfg = load_model_config(None)
    standard = random_requests(32, (32, 384), (32, 192), cfg.vocab_size, [0, 1, 2], 0)
    long_prompt = random_requests(1, (3072, 3072), (128, 128), cfg.vocab_size, [0, 1, 2],
                                  1)[0].prompt_token_ids
    configs = {
        "bf16 run, bf16 cache (default)": {},
        "bf16 run, int8 cache": {"kv_cache_dtype": "int8"},
        "bf16 run, fp8 cache": {"kv_cache_dtype": "fp8"},
        "fp32 run, fp32 cache": {"dtype": "float32"},
        "fp32 run, bf16 cache": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
        "fp32 run, int8 cache": {"dtype": "float32", "kv_cache_dtype": "int8"},
        "fp32 run, fp8 cache": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    }
    results = {name: ([], []) for name in configs}
    for r in range(args.rounds):
        for name, engine in configs.items():
            results[name][0].append(throughput(standard, **engine))
            results[name][1].append(long_context(long_prompt, **engine))
            print(f"round {r + 1} {name}: {results[name][0][-1]:.1f} tok/s standard, "
                  f"{results[name][1][-1]:.1f} tok/s decoding at 3072", flush=True)
    print("\n| configuration | standard workload, tok/s | one request at 3072, decode tok/s |")
    print("|---|---|---|")
    for name, (std, lng) in results.items():
        print(f"| {name} | {' / '.join(f'{x:.1f}' for x in std)} | "
              f"{' / '.join(f'{x:.1f}' for x in lng)} |")
    d = drift()
    print(f"\ndrift on {d['tokens']} tokens of Pride and Prejudice (fp32 arithmetic, "
          f"activation quantization none; perplexity {d['ppl_float']:.3f} with the fp32 cache):")
    for kind in ("int8", "fp8"):
        print(f"  {kind}: mean |dlogprob| {d[kind]['mean_abs']:.4f}, max "
              f"{d[kind]['max_abs']:.4f}, perplexity {d[kind]['ppl']:.3f}")


if __name__ == "__main__":
    main()
