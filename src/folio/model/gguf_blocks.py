"""GGUF blocks -> the codes, scales and offsets layers/quantization/gguf.py
holds (w = code * scale + offset), for Q4_0, Q4_1, Q8_0 and the K-quants Q4_K,
Q5_K and Q6_K: our own readers of ggml's block layouts, which give the gguf
package's dequantized values bit for bit (tests/model/quantization/
test_gguf_kquants.py). gguf_loader.py calls `split_blocks` on each packed tensor and `dequantize`
(the gguf package's numpy dequantization) on the others.
"""

from __future__ import annotations

import numpy as np
import torch

from folio.model.layers.quantization.gguf import KINDS

# bytes of one block, and the input features it holds
BLOCK_BYTES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32),
                "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def split_blocks(t, form: tuple[int, int], two_level: bool = True) -> dict[str, torch.Tensor]:
    """A packed tensor [rows, in] -> its codes, scales and offsets as
    layers/quantization/gguf.py reads them (w = code * scale + offset), in the
    held `form` (bits, group) of its layer: a part of wider codes or smaller
    groups than its own gets its codes one per byte, each scale repeated. A
    K-quant's also give each group its super-block's d and offset multiplier
    (qsuperscales, qsuperoffsets: -dmin, or Q6_K's -32 d), whose int8
    multiples the scales and offsets are, where its layer is held in two
    levels (`two_level`: every part of it a K-quant)."""
    kind = t.tensor_type.name
    cols = int(t.shape[0])                                  # ne order; experts' rows stacked
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    size, per_block = BLOCK_BYTES[kind]
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, cols // per_block, -1)
    if blocks.shape[2] != size:
        raise ValueError(f"{t.name}: {kind} blocks of {blocks.shape[2]} bytes, expected {size}")
    codes, scales, offsets, *supers = _KIND_SPLITS[kind](blocks)   # [rows, blocks, ...]
    codes = codes.reshape(rows, cols)
    bits, group = form
    repeat = KINDS[kind][1] // group
    per_group = lambda a: np.repeat(a.reshape(rows, -1), repeat, axis=1)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    as_tensor = lambda a: torch.from_numpy(
        np.ascontiguousarray(a, dtype=np.float32).reshape(rows, -1))
    parts = {"qcodes": torch.from_numpy(np.ascontiguousarray(codes.astype(np.uint8))),
             "qscales": as_tensor(per_group(scales)), "qoffsets": as_tensor(per_group(offsets))}
    if supers and two_level:    # each group's super-block's d and offset multiplier
        per_block = 256 // group
        for name, value in zip(("qsuperscales", "qsuperoffsets"), supers):
            parts[name] = as_tensor(np.repeat(value.reshape(rows, -1), per_block, axis=1))
    return parts


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (the last axis) as a float16, widened to fp32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _legacy(blocks: np.ndarray):
    """Q4_0, Q4_1, Q8_0: a float16 d (Q4_1: and m) then 32 codes."""
    d = _f16(blocks[..., :2])[..., None]                        # one group a block
    if blocks.shape[-1] == 34:                                  # Q8_0: signed bytes
        return (blocks[..., 2:].view(np.int8).astype(np.int16) + 128), d, -128 * d
    head = 4 if blocks.shape[-1] == 20 else 2
    qs = blocks[..., head:]                                     # 16 bytes: k and k + 16
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    return codes, d, (_f16(blocks[..., 2:4])[..., None] if head == 4 else -8 * d)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins: bytes
    0-3 and 4-7 hold scales and mins 0-3 in their low 6 bits (and the top 2
    bits of 4-7 in their high ones), bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and mins 4-7 (high nibble)."""
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _low_nibbles_by_32(qs: np.ndarray) -> np.ndarray:
    """128 bytes of 4-bit codes -> 256: each run of 32 bytes holds a sub-block of
    32 in its low nibbles and the next one in its high nibbles."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([runs & 0xF, runs >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(blocks: np.ndarray):
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    sc, mn = _k_scales(blocks[..., 4:16])
    return _low_nibbles_by_32(blocks[..., 16:144]), d * sc, -(dmin * mn), d, -dmin


def _q5_k(blocks: np.ndarray):
    """Q4_K's layout, with a fifth bit per code: bit j of byte i of qh is that of
    code i of sub-block j."""
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    sc, mn = _k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48]
    high = np.stack([(qh >> j) & 1 for j in range(8)], axis=-2)          # [..., 8, 32]
    codes = _low_nibbles_by_32(blocks[..., 48:176]) | (high.reshape(*qh.shape[:-1], 256) << 4)
    return codes, d * sc, -(dmin * mn), d, -dmin


def _q6_k(blocks: np.ndarray):
    """Two halves of 128 codes, each from 64 bytes of low nibbles (ql) and 32 of
    2-bit high parts (qh): code l + 32 c of a half has ql byte l (c even) or
    l + 32 (c odd), low nibble for c < 2, and bits 2c, 2c + 1 of qh byte l.
    16 int8 scales (one per 16 codes) and a float16 d; w = d sc (code - 32)."""
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])[..., None]
    halves = []
    for h in range(2):
        low, high = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        for c in range(4):
            nibbles = low[..., 32 * (c % 2):32 * (c % 2) + 32]
            nibbles = nibbles & 0xF if c < 2 else nibbles >> 4
            halves.append(nibbles | (((high >> (2 * c)) & 3) << 4))
    return np.concatenate(halves, axis=-1), d * sc, -32 * d * sc, d, -32 * d


_KIND_SPLITS = {"Q4_0": _legacy, "Q4_1": _legacy, "Q8_0": _legacy,
                "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(t) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))  # ne order -> torch order
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:
        # F32 tensors come back as views of the read-only memory map.
        values = values.copy()
    return torch.from_numpy(values)
