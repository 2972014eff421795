"""What structured outputs cost (issue 18), measured in one process on the
default model:

- per-step overhead: 8 requests decoding 64 tokens each (EOS ignored), with
  no constraint, with a regex, and with two JSON schemas (an array of at
  least 40 strings, free or of at most 8 characters), whose grammars allow no
  end within 64 tokens, so every run makes the same number of steps; the
  mean decode step time of each, and its ratio to the unconstrained one;
- time to first token of one request (a 40-token chat prompt, max_tokens=1):
  unconstrained; the first constrained request of the process (xgrammar's
  start-up and the compile); a schema not seen before (the compile); the same
  schema again (cached).

    .venv/bin/python docs/bench/structured_cost.py [--dtype auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_baselines as cb  # noqa: E402

from folio import SamplingParams  # noqa: E402
from folio.engine.llm_engine import LLMEngine  # noqa: E402

REGEX = "[a-z ]{400,}"          # no end before 400 characters: more than 64 tokens hold
LIST = {"type": "array", "items": {"type": "string"}, "minItems": 40}
# the same with bounded strings: xgrammar's mask is much dearer inside a string
# with maxLength (its token cache does not cover the counted repetition)
BOUNDED = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 40}


def run_until_done(engine, first_token: dict | None = None) -> None:
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first_token is not None and out.outputs[0].token_ids and out.request_id not in \
                    first_token:
                first_token[out.request_id] = time.perf_counter() - t0


def decode_steps(engine, ids, constraint, tag: str) -> float:
    """Mean seconds of a decode step of 8 requests x 64 tokens (prefill excluded)."""
    for i in range(8):
        engine.add_tokenized_request(f"{tag}-{i}", None, ids, SamplingParams(
            temperature=0, max_tokens=64, ignore_eos=True, structured_outputs=constraint))
    engine.step()                                  # the prefill of all 8 (one step)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def ttft(engine, ids, constraint, tag: str) -> float:
    engine.reset_prefix_cache()         # every request computes its prompt
    t0 = time.perf_counter()
    engine.add_tokenized_request(tag, None, ids, SamplingParams(
        temperature=0, max_tokens=1, structured_outputs=constraint))
    run_until_done(engine)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"{datetime.now(timezone.utc).isoformat(timespec='minutes')} | {cb.cpu_summary()}")
    engine = LLMEngine.from_args(None, dtype=args.dtype, max_model_len=2048)
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Write a long list of short words, "
                                                       "one after the other, please."}])
    print(f"dtype {engine.config.dtype}, prompt {len(ids)} tokens")
    ttft(engine, ids, None, "warm-up")
    first = {"plain": ttft(engine, ids, None, "plain")}
    first["first constrained (xgrammar start + compile)"] = ttft(
        engine, ids, {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "cold0")
    rows = {"plain": [], "regex": [], "json schema": [], "json schema, maxLength strings": []}
    fresh, cached = [], []
    for r in range(args.rounds):
        engine.reset_prefix_cache()
        rows["plain"].append(decode_steps(engine, ids, None, f"p{r}"))
        rows["regex"].append(decode_steps(engine, ids, {"regex": REGEX}, f"r{r}"))
        rows["json schema"].append(decode_steps(engine, ids, {"json": LIST}, f"j{r}"))
        rows["json schema, maxLength strings"].append(
            decode_steps(engine, ids, {"json": BOUNDED}, f"b{r}"))
        schema = {"type": "object", "properties": {f"k{r}": {"type": "string", "maxLength": 9},
                                                   "n": {"type": "integer"}},
                  "required": [f"k{r}", "n"]}
        fresh.append(ttft(engine, ids, {"json": schema}, f"f{r}"))
        cached.append(ttft(engine, ids, {"json": json.dumps(schema)}, f"c{r}"))
    first["new schema (compile)"] = statistics.median(fresh)
    first["same schema again (cached)"] = statistics.median(cached)
    base = statistics.median(rows["plain"])
    print("\n| 8 rows decoding | ms per step (median of rounds) | vs plain |")
    print("|---|---|---|")
    for name, values in rows.items():
        m = statistics.median(values)
        print(f"| {name} | {1e3 * m:.2f} | {m / base:.3f}x |")
    print("\n| one request, time to first token | ms |")
    print("|---|---|")
    for name, value in first.items():
        print(f"| {name} | {1e3 * value:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
