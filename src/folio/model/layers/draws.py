"""Random draws that are a function of where they are made, not of a
generator's state: a sampled sequence's randomness at a token is fixed by
(its seed, the token's position, a stream), so

- one call draws for every row of a batch (one kernel: `race`), with no
  per-row generator to step;
- a seeded sequence draws the same whatever else is in its batch, however its
  prompt was chunked, and after a preemption that recomputes it (the same
  position draws the same again);
- a failed batch retried row by row draws what it would have drawn.

A row's key is a 64-bit mix (splitmix64) of those three numbers, made on the
host (`row_keys`). Token v of a row gets the 32-bit hash
h(h(v ^ key_lo) ^ key_hi), h the "lowbias32" integer hash (two xor-shift-
multiply rounds), read as a uniform u = (2 (x >> 9) + 1) / 2^24 in (0, 1),
exact in fp32. `race` samples each row of a distribution by the exponential
race: argmax over v of p(v) / E(v), E = -log u ~ Exp(1), which picks v with
probability p(v). The three implementations (the torch one here, the native
CPU kernel, the Triton kernel for CUDA) compute the same integers; they may
differ only by the last bit of a log, which never decides between tokens
whose ratios differ by more.

Streams: SAMPLE (a row's token), ACCEPT (a proposal's acceptance test,
speculative decoding), RESIDUAL (a rejected proposal's replacement), DRAFT
(a draft model's proposal).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from folio.kernels import native, triton_sampling

SAMPLE, ACCEPT, RESIDUAL, DRAFT = 0, 1, 2, 3
_NUM_STREAMS = 4
_M64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B          # lowbias32's multipliers


def _splitmix(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(seeds: Sequence[int], positions: Sequence[int], stream: int) -> np.ndarray:
    """[R] int64 (the bits of a uint64): the key of each row's draw, from its
    sequence's seed (any int: taken mod 2^64), the position of the token it
    is drawn for, and the stream."""
    if isinstance(seeds, np.ndarray) and seeds.dtype == np.uint64:
        s = seeds
    else:
        s = np.fromiter((int(x) & _M64 for x in seeds), np.uint64, len(seeds))
    where = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        keys = _splitmix(_splitmix(s) ^ (where * np.uint64(_NUM_STREAMS) + np.uint64(stream)))
    return keys.view(np.int64)


def uniform(seed: int, position: int, stream: int) -> float:
    """One uniform in [0, 1) for a (seed, position, stream), on the host (53
    bits of its key)."""
    key = int(row_keys([seed], [position], stream)[0]) & _M64
    return (key >> 11) / float(1 << 53)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), in int64 without overflow (16-bit
    halves of c)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def uniforms_reference(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] fp32 in (0, 1): every token's uniform under each row's key
    (the torch definition the kernels are held to)."""
    v = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    lo = (keys & _MASK32)[:, None]
    hi = ((keys >> 32) & _MASK32)[:, None]
    x = _hash32(_hash32(v ^ lo) ^ hi)
    return ((x >> 9) * 2 + 1).float() * 2.0 ** -24


def race_reference(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R, V] non-negative weights (need not sum to 1), [R] int64 keys -> [R]
    int64: each row's draw, argmax of p / E with E = -log u."""
    u = uniforms_reference(keys.to(probs.device), probs.shape[-1])
    return (probs.float() / -torch.log(u)).argmax(dim=-1)


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's draw from its weights, in one kernel for all rows: Triton's
    on CUDA, the native one on the CPU, else the torch definition."""
    probs = probs.float().contiguous()
    keys = keys.to(device=probs.device, dtype=torch.int64).contiguous()
    if triton_sampling.serves(probs):
        return triton_sampling.race(probs, keys)
    if probs.device.type == "cpu" and native.load() is not None:
        return native.race(probs, keys)
    return race_reference(probs, keys)


def draw_one(weights: torch.Tensor, seed: int, position: int, stream: int) -> int:
    """One token from one row of non-negative weights."""
    keys = torch.from_numpy(row_keys([seed], [position], stream))
    return int(race(weights[None, :], keys)[0])


def keys_tensor(seeds: Sequence[int], positions: Sequence[int], stream: int,
                device: Optional[torch.device] = None) -> torch.Tensor:
    return torch.from_numpy(row_keys(seeds, positions, stream)).to(device or "cpu")
