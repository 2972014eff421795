"""Benchmark workloads: uniform random token ids, or a JSONL file of requests."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt: Optional[str] = None


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, special_ids, seed: int = 0) -> list[BenchRequest]:
    """Uniform lengths and random token ids that avoid special tokens."""
    rng = random.Random(seed)
    special = set(special_ids)
    ordinary = [t for t in range(vocab_size) if t not in special]
    return [BenchRequest([rng.choice(ordinary) for _ in range(rng.randint(*input_len))],
                         rng.randint(*output_len))
            for _ in range(num)]


def jsonl_requests(path: str, tokenizer, default_max_tokens: int = 128) -> list[BenchRequest]:
    """One request a line: {"prompt": "...", "max_tokens": N} or {"prompt_token_ids": [...], ...}."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            max_tokens = int(item.get("max_tokens", default_max_tokens))
            if "prompt_token_ids" in item:
                out.append(BenchRequest(list(item["prompt_token_ids"]), max_tokens))
            elif "prompt" in item:
                out.append(BenchRequest(tokenizer.encode(item["prompt"]), max_tokens,
                                        item["prompt"]))
            else:
                raise ValueError(f"{path}:{lineno}: a request needs 'prompt' or 'prompt_token_ids'")
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out
