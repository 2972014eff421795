"""Sampling's random draws for every row of a batch in one launch (CUDA,
Triton): `race` is model/layers/draws.py's exponential race, one program a
row walking its vocabulary in tiles, each token's uniform hashed from the
row's key and the token's id in uint32 arithmetic (what the torch definition
computes in int64), its -log taken, p / E compared, the first maximum kept.
Where torch would launch a generator's draw for each row and then divide and
reduce, this is one kernel whatever the batch. `penalize` applies the
repetition, frequency and presence penalties reading the runner's
persistent counts in place (worker/sampling_columns.py)."""

from __future__ import annotations

import importlib.util

import torch

from folio.kernels import triton_elementwise

_AVAILABLE = importlib.util.find_spec("triton") is not None
if _AVAILABLE:
    import triton
    import triton.language as tl

_BLOCK = 1024


def serves(x: torch.Tensor) -> bool:
    """CUDA tensors where triton is installed (and CPU ones under the tests'
    interpreter switch, triton_elementwise.ON_CPU_FOR_TESTS)."""
    on_device = x.is_cuda or (triton_elementwise.ON_CPU_FOR_TESTS and x.device.type == "cpu")
    return on_device and _AVAILABLE


if _AVAILABLE:
    @triton.jit
    def _lowbias32(x):
        # uint32 throughout: the products wrap mod 2^32
        x = x ^ (x >> 16)
        x = x * tl.full((), 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full((), 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _race_kernel(probs_ptr, keys_ptr, out_ptr, stride, V, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        key = tl.load(keys_ptr + r)
        lo = (key & 0xFFFFFFFF).to(tl.uint32)
        hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        best = tl.full((), -1.0, tl.float32)
        best_i = tl.full((), 0, tl.int64)
        for start in range(0, V, BLOCK):
            v = start + tl.arange(0, BLOCK)
            m = v < V
            p = tl.load(probs_ptr + r * stride + v, mask=m, other=0.0)
            x = _lowbias32(_lowbias32(v.to(tl.uint32) ^ lo) ^ hi)
            u = ((x >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08   # 2^-24
            ratio = tl.where(m, p / -tl.log(u), -1.0)
            tile_best = tl.max(ratio, axis=0)
            # the first index holding the tile's maximum
            tile_i = tl.min(tl.where(ratio == tile_best, v, V), axis=0).to(tl.int64)
            take = tile_best > best
            best_i = tl.where(take, tile_i, best_i)
            best = tl.where(take, tile_best, best)
        tl.store(out_ptr + r, best_i)


if _AVAILABLE:
    @triton.jit
    def _penalize_kernel(x_ptr, out_ptr, counts_ptr, seen_ptr, rows_ptr, presence_ptr,
                         frequency_ptr, repetition_ptr, V, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = v < V
        row = tl.load(rows_ptr + r)
        x = tl.load(x_ptr + r * V + v, mask=m, other=0.0)
        k = tl.load(counts_ptr + row * V + v, mask=m, other=0.0)
        s = tl.load(seen_ptr + row * V + v, mask=m, other=0) != 0
        rep = tl.load(repetition_ptr + r)
        f = tl.load(frequency_ptr + r)
        p = tl.load(presence_ptr + r)
        x = tl.where(s, tl.where(x > 0, x / rep, x * rep), x)
        x = x - f * k
        x = tl.where(k > 0, x - p, x)
        tl.store(out_ptr + r * V + v, x, mask=m)


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
             rows: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
             repetition: torch.Tensor) -> torch.Tensor:
    """Penalties read in place from the persistent tables (the native
    kernel's contract, kernels/native/__init__.py `penalize`)."""
    logits = logits.float().contiguous()
    out = torch.empty_like(logits)
    n, vocab = logits.shape
    if n:
        _penalize_kernel[(n, triton.cdiv(vocab, _BLOCK))](
            logits, out, counts, seen.view(torch.uint8), rows, presence, frequency,
            repetition, vocab, BLOCK=_BLOCK)
    return out


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """probs [R, V] fp32 (contiguous rows), keys [R] int64 -> [R] int64."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows:
        _race_kernel[(rows,)](probs, keys, out, probs.stride(0), vocab, BLOCK=_BLOCK)
    return out
