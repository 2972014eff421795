"""Triton kernels of the TRITON attention backend, on the common paged layout
(per layer [2, num_blocks, block_size, num_kv_heads, head_dim]).

- `store_kv`: the step's keys and values into their slots (a negative slot is
  a padding token and writes nothing).
- `paged_decode`: one query token per sequence over its block table. A
  program takes one sequence and one KV head: the query heads of its group
  are the rows of its matmuls (`tl.dot`, padded to 16 rows), so each key is
  read once for all of them; each page's block id is read once. Only when
  sequences x KV heads would leave the device's cores idle is the context
  split (flash-decoding): each split's program writes a partial result and
  `_combine_kernel` merges them; otherwise the program writes the answer.
- `paged_prefill`: the step's prompt chunks, every sequence in one launch. A
  program takes BLOCK_M query tokens of one chunk and one KV head (its rows
  are tokens x query heads of the group) and walks the keys through the
  block table (whole pages, as the decode does) up to the tile's last
  position, so the keys past a causal tile are never read; the mask is causal by absolute
  position, so a chunk that resumes mid-prompt (or after a prefix-cache hit)
  sees every key before it, all read from the cache the step just wrote.

- `paged_mixed`: a step of decodes and prompt chunks in one launch (the
  decode programs first, unsplit, then the chunks' tiles), the two bodies
  above as functions of their program's ids.

A sliding window W > 0 (a local layer) limits a query at position p to the
keys p - W < k <= p: a decode's splits share out only the last W keys, a
prefill tile starts at its first token's first key.

An 8-bit cache (--kv-cache-dtype int8|fp8, kv_quant.py) holds rows of D
int8 steps or e4m3 bytes and their fp32 scale (ROW = D + 4 elements a row):
its rows are quantized by torch when stored, and the kernels widen the
values and multiply each key and value row by its scale as they load it.

Keys are taken BLOCK_N at a time; a block size that is a power of 2 gives
tiles of whole pages (or tiles inside one page), any other has each key's
block looked up from its own position. Softmax sums are fp32; the matmuls
take fp16/bf16 inputs as they are on a GPU (`DOT_FP32` upcasts them, for
fp32 models and for the CPU interpreter, `TRITON_INTERPRET=1`, whose bf16
arithmetic is not right). A decode's scores may be soft-capped
(softcap * tanh(s / softcap), Gemma 2's attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from folio.model.attention import kv_quant


NO_WINDOW = 1 << 40     # the kernels' window of a global layer: longer than any context


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr, k_stride, v_stride,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    tl.store(k_cache + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache + slot * ROW + offs, v, mask=mask)


def _eight(cache: torch.Tensor) -> int:
    """The kernels' EIGHT of a cache: 0 float, 1 int8, 2 fp8 e4m3 (uint8
    bytes), 3 fp8 e5m2."""
    return {torch.int8: 1, torch.uint8: 2, torch.float8_e5m2: 3}.get(cache.dtype, 0)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An e5m2 cache as its bytes (the kernels widen them themselves)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e5m2 else cache


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads contiguous (a view of the
    fused projection is); otherwise a contiguous copy."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, static=(None, None)) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [num_blocks, block_size, Hkv, D] at slot_mapping;
    a cache of another dtype (--kv-cache-dtype) takes them rounded by torch
    (round to nearest even; triton's interpreter truncates)."""
    if k.dtype != k_cache.dtype:            # an 8-bit cache: each row's steps and scale
        k = kv_quant.stored(k, k_cache.dtype, static[0])
        v = kv_quant.stored(v, v_cache.dtype, static[1])
    k, v = _bytes(_rows(k)), _bytes(_rows(v))
    row = k.shape[1] * k.shape[2]
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0],)](k, v, _bytes(k_cache), _bytes(v_cache), slot_mapping,
                                        k.stride(0), v.stride(0), ROW=row, ROW_PAD=_pow2(row))


@triton.jit
def _key_slots(table, n0, pos, valid, end, BS: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGES: tl.constexpr):
    """The cache slots (block * BS + offset) of the BLOCK_N keys from n0 (a
    multiple of BLOCK_N where PAGES > 0) through one sequence's block table.
    PAGES (`tile_pages`): 1, the tile lies in one page, whose block id is
    read once; > 1, the tile is PAGES whole pages, each block id read once; 0
    (a block size not a power of 2), each key's block read on its own."""
    if PAGES == 0:
        block = tl.load(table + pos // BS, mask=valid, other=0).to(tl.int64)
        return block * BS + pos % BS
    elif PAGES == 1:
        block = tl.load(table + n0 // BS).to(tl.int64)
        return block * BS + n0 % BS + tl.arange(0, BLOCK_N)
    else:
        page = n0 // BS + tl.arange(0, PAGES)
        blocks = tl.load(table + page, mask=page * BS < end, other=0).to(tl.int64)
        return tl.reshape(blocks[:, None] * BS + tl.arange(0, BS)[None, :], [BLOCK_N])


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, out_ptr, m_ptr, l_ptr, tables, ctx_lens, scale,
                   q_stride, out_stride, table_stride, tokens_per_split, window, softcap,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BS: tl.constexpr, BLOCK_N: tl.constexpr, PAGES: tl.constexpr,
                   ROW: tl.constexpr, EIGHT: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr, STAGES: tl.constexpr):
    _decode_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2),
                    q_ptr, k_cache, v_cache, out_ptr, m_ptr, l_ptr, tables, ctx_lens, scale,
                    q_stride, out_stride, table_stride, tokens_per_split, window, softcap,
                    NUM_HEADS, NUM_KV_HEADS, G, G_PAD, D, D_PAD, BS, BLOCK_N, PAGES, ROW,
                    EIGHT, SPLIT, DOT_FP32, SOFTCAP, STAGES)


@triton.jit
def _decode_program(s, kvh, split, num_splits, q_ptr, k_cache, v_cache, out_ptr, m_ptr, l_ptr,
                    tables, ctx_lens, scale, q_stride, out_stride, table_stride,
                    tokens_per_split, window, softcap, NUM_HEADS: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGES: tl.constexpr, ROW: tl.constexpr,
                    EIGHT: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                    SOFTCAP: tl.constexpr, STAGES: tl.constexpr):
    """Sequence s's query heads of KV head kvh over split `split` of its keys."""
    ctx = tl.load(ctx_lens + s)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    gm, dm = g < G, d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + s * q_stride + heads[:, None] * D + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    lo = tl.maximum(ctx - window, 0)            # the first key seen (NO_WINDOW: 0)
    # splits share out the keys from lo's tile on, in whole tiles
    start = (lo // BLOCK_N) * BLOCK_N + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)
    table = tables + s * table_stride
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        pos = n0 + n
        valid = (pos < end) & (pos >= lo)
        offs = (_key_slots(table, n0, pos, valid, end, BS, BLOCK_N, PAGES) * NUM_KV_HEADS
                + kvh) * ROW
        kv_mask = valid[:, None] & dm[None, :]
        k = _load_rows(k_cache, offs, d, valid, kv_mask, D, EIGHT)
        v = _load_rows(v_cache, offs, d, valid, kv_mask, D, EIGHT)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid[None, :], scale, softcap, m_i,
                                             l_i, acc, DOT_FP32, SOFTCAP)
    if SPLIT:               # partial sums, merged by _combine_kernel
        part = (s * NUM_HEADS + heads) * num_splits + split                  # [G_PAD]
        tl.store(m_ptr + part, m_i, mask=gm)
        tl.store(l_ptr + part, l_i, mask=gm)
        tl.store(out_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=gm[:, None])
    else:                   # the whole context in this program: the answer itself
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + s * out_stride + heads[:, None] * D + d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])


@triton.jit
def _online_softmax_step(q, k, v, allowed, scale, softcap, m_i, l_i, acc,
                         DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile of keys k and values v [BLOCK_N, D_PAD] for the query rows q
    [R, D_PAD]: scores (soft-capped where SOFTCAP), `allowed` [R or 1,
    BLOCK_N] of them kept, folded into the running max m_i, sum l_i and
    accumulator acc (fp32); the products in fp32 (DOT_FP32) or in q's dtype.
    A row that has seen no key yet (its window starts past these) stays at
    -inf without a NaN. -> (m_i, l_i, acc)."""
    if DOT_FP32:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k.to(q.dtype)))
    scores = scores * scale
    if SOFTCAP:             # softcap * tanh(scores / softcap)
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _load_rows(cache, offs, d, valid, kv_mask, D: tl.constexpr, EIGHT: tl.constexpr):
    """BLOCK_N cached rows of one KV head: a float cache's as they are (EIGHT
    0), an 8-bit one's widened to fp32: 1
    int8 steps, 2 fp8 e4m3 bytes (exponent rebiased, a subnormal given
    exponent 1 and 2^-6 taken off, as native/simd.h does), 3 fp8 e5m2 bytes
    (a float16's top byte); an 8-bit row's
    values times its scale (the fp32 in its last 4 bytes)."""
    x = tl.load(cache + offs[:, None] + d[None, :], mask=kv_mask, other=0)
    if EIGHT == 3:          # e5m2: a float16's top byte
        x = ((x.to(tl.int32) & 0xFF) << 8).to(tl.uint16).to(tl.float16, bitcast=True)
    if EIGHT == 2:
        b = x.to(tl.int32) & 0xFF
        o = (b & 0x7F) << 20
        biased = o + (120 << 23)
        low = (biased + (1 << 23)).to(tl.float32, bitcast=True) - 0.015625
        x = tl.where((o & (0xF << 23)) == 0, low, biased.to(tl.float32, bitcast=True))
        x = tl.where((b & 0x80) != 0, -x, x)
    if EIGHT > 0:
        x = x.to(tl.float32)
        scale = tl.load((cache + offs + D).to(tl.pointer_type(tl.float32)), mask=valid,
                        other=0.0)
        x = x * scale[:, None]
    return x


@triton.jit
def _combine_kernel(part_out, part_m, part_l, out_ptr, out_stride, num_splits,
                    NUM_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    SPLITS_PAD: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    spm = sp < num_splits
    part = (s * NUM_HEADS + h) * num_splits + sp
    m = tl.load(part_m + part, mask=spm, other=float("-inf"))
    l_ = tl.load(part_l + part, mask=spm, other=0.0)
    top = tl.max(m, axis=0)                   # split 0 always holds a key: finite
    w = tl.where(spm & (l_ > 0), tl.exp(m - top), 0.0)
    acc = tl.load(part_out + part[:, None] * D_PAD + d[None, :], mask=spm[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_, axis=0)
    tl.store(out_ptr + s * out_stride + h * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def tile_pages(block_size: int, block_n: int) -> int:
    """The kernels' PAGES: the whole pages a tile of `block_n` keys
    spans (1: the tile lies in one page), or 0 for a block size that is not a
    power of 2 (each key's block id then read on its own)."""
    if block_size & (block_size - 1):
        return 0
    return max(block_n // block_size, 1)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float, out: torch.Tensor,
                 num_splits: int, tokens_per_split: int, block_n: int = 32,
                 window: int = 0, softcap: float = 0.0, dot_fp32: bool = False,
                 stages: int = 2, num_warps: int = 4) -> None:
    """q [S, H, D] (one token per sequence) -> out [S, H, D] (rows contiguous).

    One program per (sequence, KV head, split): the G query heads of the KV
    head are the rows of its matmuls (padded to 16, the smallest tl.dot),
    keys and values are taken `block_n` at a time, a page's block id read
    once, and `num_splits` > 1 (split-KV, for launches that would leave the
    device's cores idle) shares the keys out in whole tiles of
    `tokens_per_split`, merged by one combine launch. A sequence sees its last
    `window` keys where that is > 0 (the splits must then cover window +
    block_n keys); `softcap` > 0 caps the scores as softcap * tanh(s /
    softcap). `dot_fp32`: products in fp32 (fp32 queries, and triton's
    interpreter, whose half-precision arithmetic is not right)."""
    q = _rows(q)
    S, H, D = q.shape
    _, bs, hkv, row = k_cache.shape
    G, d_pad = H // hkv, max(_pow2(D), 16)
    block_n = max(block_n, 16)
    split = num_splits > 1
    if split:
        assert tokens_per_split % block_n == 0, "splits are whole tiles of keys"
        part_out = torch.empty(S * H * num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(S * H * num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out, part_m, part_l = out, out, out        # written directly, unused
    eight = _eight(k_cache)
    k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
    _decode_kernel[(S, hkv, num_splits)](
        q, k_cache, v_cache, part_out, part_m, part_l, tables, ctx_lens, scale, q.stride(0),
        out.stride(0), tables.stride(0), tokens_per_split, window or NO_WINDOW,
        float(softcap), NUM_HEADS=H, NUM_KV_HEADS=hkv, G=G, G_PAD=max(_pow2(G), 16),
        D=D, D_PAD=d_pad, BS=bs, BLOCK_N=block_n, PAGES=tile_pages(bs, block_n),
        ROW=row, EIGHT=eight, SPLIT=split,
        DOT_FP32=dot_fp32 or q.dtype == torch.float32, SOFTCAP=softcap > 0, STAGES=stages,
        num_warps=num_warps)
    if split:
        _combine_kernel[(S, H)](part_out, part_m, part_l, out, out.stride(0), num_splits,
                                NUM_HEADS=H, D=D, D_PAD=d_pad,
                                SPLITS_PAD=_pow2(num_splits))


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, tables, tile_seq, tile_q0, q_starts,
                    q_lens, start_positions, scale, q_stride, out_stride, table_stride, window,
                    softcap, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                    ROW: tl.constexpr, EIGHT: tl.constexpr, PAGES: tl.constexpr,
                    SOFTCAP: tl.constexpr, STAGES: tl.constexpr):
    _prefill_program(tl.program_id(0), tl.program_id(1), q_ptr, k_cache, v_cache, out_ptr,
                     tables, tile_seq, tile_q0, q_starts, q_lens, start_positions, scale,
                     q_stride, out_stride, table_stride, window, softcap, NUM_KV_HEADS, G,
                     G_PAD, D, D_PAD, BS, BLOCK_M, BLOCK_N, DOT_FP32, ROW, EIGHT, PAGES,
                     SOFTCAP, STAGES)


@triton.jit
def _mixed_kernel(q_ptr, k_cache, v_cache, out_ptr, dec_tables, ctx_lens, tables, tile_seq,
                  tile_q0, q_starts, q_lens, start_positions, num_decodes, scale, q_stride,
                  out_stride, table_stride, all_keys, window, softcap, NUM_HEADS: tl.constexpr,
                  NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, DEC_G_PAD: tl.constexpr,
                  G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                  ROW: tl.constexpr, EIGHT: tl.constexpr, PAGES: tl.constexpr,
                  SOFTCAP: tl.constexpr, STAGES: tl.constexpr):
    """A mixed step in one launch: programs 0 .. num_decodes - 1 are the
    decodes (unsplit), the rest the prompt chunks' tiles."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if pid < num_decodes:
        _decode_program(pid, kvh, 0, 1, q_ptr, k_cache, v_cache, out_ptr, out_ptr, out_ptr,
                        dec_tables, ctx_lens, scale, q_stride, out_stride, table_stride,
                        all_keys, window, softcap, NUM_HEADS, NUM_KV_HEADS, G, DEC_G_PAD, D,
                        D_PAD, BS, BLOCK_N, PAGES, ROW, EIGHT, False, DOT_FP32, SOFTCAP,
                        STAGES)
    else:
        _prefill_program(pid - num_decodes, kvh, q_ptr, k_cache, v_cache, out_ptr, tables,
                         tile_seq, tile_q0, q_starts, q_lens, start_positions, scale,
                         q_stride, out_stride, table_stride, window, softcap, NUM_KV_HEADS, G,
                         G_PAD, D, D_PAD, BS, BLOCK_M, BLOCK_N, DOT_FP32, ROW, EIGHT, PAGES,
                         SOFTCAP, STAGES)


@triton.jit
def _prefill_program(tile, kvh, q_ptr, k_cache, v_cache, out_ptr, tables, tile_seq, tile_q0,
                     q_starts, q_lens, start_positions, scale, q_stride, out_stride,
                     table_stride, window, softcap, NUM_KV_HEADS: tl.constexpr,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                     D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, ROW: tl.constexpr,
                     EIGHT: tl.constexpr, PAGES: tl.constexpr, SOFTCAP: tl.constexpr,
                     STAGES: tl.constexpr):
    """Tile `tile` of the prompt chunks: its BLOCK_M tokens x KV head kvh's query heads."""
    i = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q0 + tile)
    q_start = tl.load(q_starts + i)
    q_len = tl.load(q_lens + i)
    start_pos = tl.load(start_positions + i)
    r = tl.arange(0, BLOCK_M * G_PAD)         # rows: tokens x query heads of the group
    tok = q0 + r // G_PAD
    head = kvh * G + r % G_PAD
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    rm = (tok < q_len) & (r % G_PAD < G)
    dm = d < D
    q_pos = start_pos + tok                   # absolute positions
    q = tl.load(q_ptr + (q_start + tok)[:, None] * q_stride + head[:, None] * D + d[None, :],
                mask=rm[:, None] & dm[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
    end = start_pos + tl.minimum(q0 + BLOCK_M, q_len)      # keys 0 .. the tile's last position
    # a window: from the tile of keys of the first key its first token sees
    # (the keys before that one are masked as the causal ones are)
    first = tl.maximum(start_pos + q0 - window + 1, 0)
    table = tables + i * table_stride
    for n0 in tl.range((first // BLOCK_N) * BLOCK_N, end, BLOCK_N, num_stages=STAGES):
        pos = n0 + n
        valid = pos < end
        offs = (_key_slots(table, n0, pos, valid, end, BS, BLOCK_N, PAGES) * NUM_KV_HEADS
                + kvh) * ROW
        kv_mask = valid[:, None] & dm[None, :]
        k = _load_rows(k_cache, offs, d, valid, kv_mask, D, EIGHT)
        v = _load_rows(v_cache, offs, d, valid, kv_mask, D, EIGHT)
        causal = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        causal = causal & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, scale, softcap, m_i, l_i, acc,
                                             DOT_FP32, SOFTCAP)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]     # padding rows may have seen no key
    tl.store(out_ptr + (q_start + tok)[:, None] * out_stride + head[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, tables: torch.Tensor, tile_seq: torch.Tensor,
                  tile_q0: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                  start_positions: torch.Tensor, scale: float, block_m: int,
                  block_n: int = 32, dot_fp32: bool = False, window: int = 0,
                  softcap: float = 0.0, stages: int = 2) -> None:
    """The prompt chunks of q [T, H, D] -> the same rows of out [T, H, D]; chunk
    i is rows q_starts[i] .. + q_lens[i] at positions start_positions[i] ..,
    its keys in the cache through tables[i]; one program per (tile, KV head),
    tile t the `block_m` tokens of chunk tile_seq[t] from tile_q0[t] (with
    block_m x query heads per group >= 16 rows, the smallest triton matmul).
    `dot_fp32` upcasts half-precision matmul inputs (the interpreter needs it;
    fp32 q takes that path, whatever the cache: a bf16 cache of an fp32 run is
    read widened);
    `window` > 0: each token sees its last `window` keys only."""
    q = _rows(q)
    H, D = q.shape[1], q.shape[2]
    _, bs, hkv, row = k_cache.shape
    G = H // hkv
    g_pad = _pow2(G)
    fp32 = q.dtype == torch.float32 or dot_fp32
    eight = _eight(k_cache)
    k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
    _prefill_kernel[(tile_seq.shape[0], hkv)](
        q, k_cache, v_cache, out, tables, tile_seq, tile_q0, q_starts, q_lens,
        start_positions, scale, q.stride(0), out.stride(0), tables.stride(0),
        window or NO_WINDOW, float(softcap), NUM_KV_HEADS=hkv, G=G, G_PAD=g_pad, D=D,
        D_PAD=max(_pow2(D), 16), BS=bs,
        BLOCK_M=block_m, BLOCK_N=max(block_n, 16), DOT_FP32=fp32, ROW=row,
        EIGHT=eight, PAGES=tile_pages(bs, max(block_n, 16)),
        SOFTCAP=softcap > 0, STAGES=stages)


def paged_mixed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out: torch.Tensor, num_decodes: int, decode_tables: torch.Tensor,
                ctx_lens: torch.Tensor, tables: torch.Tensor, tile_seq: torch.Tensor,
                tile_q0: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                start_positions: torch.Tensor, scale: float, block_m: int,
                block_n: int = 32, dot_fp32: bool = False, window: int = 0,
                softcap: float = 0.0, stages: int = 2) -> None:
    """A step of decodes (the first `num_decodes` rows of q) and prompt chunks
    in one launch: `paged_decode` unsplit for the decodes (`decode_tables`,
    `ctx_lens`), `paged_prefill` for the chunks (the other arguments, as
    there); one program per decode or tile, per KV head."""
    q = _rows(q)
    H, D = q.shape[1], q.shape[2]
    _, bs, hkv, row = k_cache.shape
    G = H // hkv
    block_n = max(block_n, 16)
    eight = _eight(k_cache)
    k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
    _mixed_kernel[(num_decodes + tile_seq.shape[0], hkv)](
        q, k_cache, v_cache, out, decode_tables, ctx_lens, tables, tile_seq, tile_q0, q_starts,
        q_lens, start_positions, num_decodes, scale, q.stride(0), out.stride(0),
        tables.stride(0), NO_WINDOW, window or NO_WINDOW, float(softcap), NUM_HEADS=H,
        NUM_KV_HEADS=hkv, G=G, DEC_G_PAD=max(_pow2(G), 16), G_PAD=_pow2(G),
        D=D, D_PAD=max(_pow2(D), 16), BS=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=dot_fp32 or q.dtype == torch.float32, ROW=row, EIGHT=eight,
        PAGES=tile_pages(bs, block_n), SOFTCAP=softcap > 0, STAGES=stages)
