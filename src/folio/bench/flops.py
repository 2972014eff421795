"""Model FLOPs of a workload and the machine's matmul ceiling.

A request's FLOPs are what its model says of itself (model/shape.py's
sequence_flops): 2 x the linear parameters each processed token runs (its
experts only, in a mixture of experts), 4 x the query width per key attended
(a sliding-window layer's keys at most its window), 2 x the LM head per
sampled token.
"""

from __future__ import annotations

import statistics
import time

import torch

from folio.bench.datasets import BenchRequest
from folio.config import ModelConfig
from folio.model.shape import shape_of


def workload_flops(m: ModelConfig, requests: list[BenchRequest]) -> float:
    shape = shape_of(m)
    # The model runs the prompt and every output token but the last one.
    return sum(shape.sequence_flops(len(r.prompt_token_ids) + r.max_tokens - 1, r.max_tokens)
               for r in requests)


def measure_ceiling(m: ModelConfig, dtype: torch.dtype, device: str = "cpu",
                    rows: int = 512, repeats: int = 12) -> float:
    """Median GFLOP/s of a [rows x hidden] @ [hidden x intermediate] product.

    Where the engine multiplies with prepacked weights (bf16 on the CPU), the
    packed products (oneDNN's, and the native kernel's where the CPU serves it)
    are timed too and the fastest is the ceiling: the fraction is never
    flattered by a slower reference than the engine uses."""
    from folio.kernels import native
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
