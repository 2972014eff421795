"""Model FLOPs of a workload and the machine's matmul ceiling.

FLOPs = sum over every processed token of 2 x (non-embedding linear parameters)
      + sum over sampled positions of 2 x (LM-head parameters)
      + attention: 4 x context length x hidden size, per layer, per token.
"""

from __future__ import annotations

import statistics
import time

import torch

from folio.bench.datasets import BenchRequest
from folio.config import ModelConfig


def linear_params_per_layer(m: ModelConfig) -> int:
    q = m.num_attention_heads * m.head_dim
    kv = m.num_key_value_heads * m.head_dim
    attn = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    mlp = 3 * m.hidden_size * m.intermediate_size
    return attn + mlp


def workload_flops(m: ModelConfig, requests: list[BenchRequest]) -> float:
    linear = linear_params_per_layer(m) * m.num_hidden_layers
    head = m.vocab_size * m.hidden_size
    total = 0.0
    for r in requests:
        # The model runs the prompt and every output token but the last one;
        # the token at position p attends to p + 1 positions.
        processed = len(r.prompt_token_ids) + r.max_tokens - 1
        context_sum = processed * (processed + 1) / 2
        total += 2 * linear * processed + 2 * head * r.max_tokens
        total += 4 * m.hidden_size * m.num_hidden_layers * context_sum
    return total


def measure_ceiling(m: ModelConfig, dtype: torch.dtype, device: str = "cpu",
                    rows: int = 512, repeats: int = 12) -> float:
    """Median GFLOP/s of a [rows x hidden] @ [hidden x intermediate] product.

    Where the engine multiplies with prepacked weights (bf16 on the CPU), the
    packed products (oneDNN's, and the native kernel's where the CPU serves it)
    are timed too and the fastest is the ceiling: the fraction is never
    flattered by a slower reference than the engine uses."""
    from folio.model import native
    from folio.model.layers.linear import linear, pack_onednn, pack_weight
    a = torch.randn(rows, m.hidden_size, device=device).to(dtype)
    w = torch.randn(m.intermediate_size, m.hidden_size, device=device).to(dtype)
    b = w.t()
    flops = 2 * rows * m.hidden_size * m.intermediate_size
    products = [lambda: torch.matmul(a, b)]
    packs = [pack_onednn(w), pack_weight(w) if native.packs_linear(w) else None]
    for packed in filter(None, packs):
        products.append(lambda packed=packed: linear(a, w, packed))
    return max(flops / _median_seconds(p, device, repeats) / 1e9 for p in products)


def _median_seconds(product, device: str, repeats: int) -> float:
    for _ in range(3):
        product()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            product()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 8)
    return statistics.median(times)
