"""The TRITON attention backend against the portable torch backend, on random
steps: every kernel (store, split decode and its combine, paged prefill) on
the CPU under triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py
sets without a GPU), or on a GPU where there is one. Shapes are small: the
interpreter runs each program in Python."""

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="the TRITON backend needs triton (the dev extra pins it)")

from folio.model.attention.backend import StepDescription
from folio.model.attention.torch_backend import TorchAttentionBackend
from folio.model.attention.triton_backend import (
    TritonAttentionBackend, split_plan)

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_step(seqs, block_size, num_blocks, rng):
    """seqs: (start_pos, query_len) per sequence, decodes (query_len 1) first.
    Each gets distinct random blocks covering start + query."""
    free = list(rng.permutation(num_blocks))
    tables, slots, positions = [], [], []
    for start, n in seqs:
        need = -(-(start + n) // block_size)
        table = np.array([free.pop() for _ in range(need)], dtype=np.int64)
        p = np.arange(start, start + n, dtype=np.int64)
        tables.append(table)
        slots.append(table[p // block_size] * block_size + p % block_size)
        positions.append(p)
    return StepDescription(
        query_lens=[n for _, n in seqs], start_positions=[s for s, _ in seqs],
        block_tables=tables, slot_mapping=np.concatenate(slots),
        positions=np.concatenate(positions), num_decodes=sum(n == 1 for _, n in seqs),
        device=DEVICE)


def run_both(seqs, *, block_size=16, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32,
             seed=0, backend=TritonAttentionBackend):
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in seqs) + 3
    step = make_step(seqs, block_size, num_blocks, rng)
    g = torch.Generator().manual_seed(seed)
    T = len(step.slot_mapping)
    # q, k, v as views of one fused projection, as the model gives them
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (x.view(T, -1, head_dim).to(DEVICE) for x in (q, k, v))
    shape = TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)   # the earlier tokens' keys
    scale = head_dim ** -0.5
    ref_cache = cache.float().clone()
    ref = TorchAttentionBackend(heads, kv_heads, head_dim, scale).forward(
        q.float(), k.float(), v.float(), ref_cache, TorchAttentionBackend.build_metadata(step))
    got_cache = cache.clone()
    got = backend(heads, kv_heads, head_dim, scale).forward(
        q, k, v, got_cache, backend.build_metadata(step))
    return got, ref, got_cache, ref_cache


def assert_close(got, ref, dtype):
    assert got.dtype == dtype and got.shape == ref.shape
    err = (got.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


class ForcedSplits(TritonAttentionBackend):
    """Many programs wanted, splits of 32 keys: short contexts cross split points."""
    target_programs = 1 << 20
    min_split_tokens = 32


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_decode_over_block_tables_and_splits(block_size, heads, kv_heads):
    # contexts of 1 key, one block exactly, across blocks and across splits
    seqs = [(0, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size + 5, 1), (100, 1)]
    got, ref, got_cache, ref_cache = run_both(seqs, block_size=block_size, heads=heads,
                                              kv_heads=kv_heads, backend=ForcedSplits)
    assert_close(got, ref, torch.float32)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)   # written exactly


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_decodes_and_chunks_after_earlier_keys(head_dim):
    # decodes; a whole prompt; a chunk resuming mid-prompt (or after a prefix
    # hit) whose tiles start off block boundaries; a one-block chunk
    seqs = [(40, 1), (7, 1), (0, 37), (45, 20), (16, 16)]
    got, ref, *_ = run_both(seqs, heads=6, kv_heads=2, head_dim=head_dim)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    seqs = [(70, 1), (3, 1), (0, 21), (33, 18)]
    got, ref, got_cache, ref_cache = run_both(seqs, heads=4, kv_heads=1, dtype=dtype,
                                              block_size=32, backend=ForcedSplits)
    assert_close(got, ref, dtype)
    assert torch.equal(got_cache.float(), ref_cache)


HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def _on_a_cache(seed, dtype, make_cache):
    """A step of decodes and prompt chunks over `make_cache(g, num_blocks)`:
    (queries' inputs, the cache before, the torch backend's answer and cache,
    TRITON's answer and cache); decodes split by ForcedSplits."""
    seqs, block_size = [(70, 1), (3, 1), (0, 21), (33, 18)], 16
    num_blocks = sum(-(-(s + n) // block_size) for s, n in seqs) + 3
    step = make_step(seqs, block_size, num_blocks, np.random.default_rng(seed))
    g = torch.Generator().manual_seed(seed)
    T = len(step.slot_mapping)
    qkv = tuple(torch.randn(T, h, HEAD_DIM, generator=g).to(dtype).to(DEVICE)
                for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = make_cache(g, num_blocks, block_size).to(DEVICE)
    scale = HEAD_DIM ** -0.5
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, scale).forward(
        *qkv, ref_cache, TorchAttentionBackend.build_metadata(step))
    got = ForcedSplits(HEADS, KV_HEADS, HEAD_DIM, scale).forward(
        *qkv, got_cache, ForcedSplits.build_metadata(step))
    return qkv, cache, (ref, ref_cache), (got, got_cache), step


def test_float32_queries_on_a_bfloat16_cache():
    """--kv-cache-dtype bfloat16 under a float32 run: the store rounds the new
    keys to bf16 as torch does, decode and prefill read the cache widened, as
    the torch backend does on the same cache."""
    shape = lambda nb, bs: TorchAttentionBackend.get_kv_cache_shape(  # noqa: E731
        nb, bs, KV_HEADS, HEAD_DIM)
    qkv, cache, (ref, ref_cache), (got, got_cache), step = _on_a_cache(
        5, torch.float32, lambda g, nb, bs: torch.randn(shape(nb, bs), generator=g).to(
            torch.bfloat16))
    assert torch.equal(got_cache, ref_cache)           # the same bf16 bits
    assert not torch.equal(got_cache, cache)
    assert_close(got, ref, torch.float32)
    # the fp32 keys themselves would answer otherwise: the cache was read as bf16
    wide = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5).forward(
        *qkv, cache.float(), TorchAttentionBackend.build_metadata(step))
    assert (wide - got).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_8bit_cache(dtype, kind):
    """--kv-cache-dtype int8, fp8 and fp8_e5m2: the store writes each row's
    steps (e4m3 or e5m2 bytes) and scale as torch's quantization does, and
    decode (split) and prefill read the rows widened and scaled, as the torch
    backend does on the same cache."""
    from folio.model.attention import kv_quant
    _, cache, (ref, ref_cache), (got, got_cache), _ = _on_a_cache(
        7, dtype, lambda g, nb, bs: kv_quant.quantize(
            torch.randn(2, nb, bs, KV_HEADS, HEAD_DIM, generator=g), kind))
    got_cache, ref_cache, cache = (c.view(torch.uint8) for c in (got_cache, ref_cache, cache))
    assert torch.equal(got_cache, ref_cache) and not torch.equal(got_cache, cache)
    assert_close(got, ref.float(), dtype)


def test_any_block_size_and_odd_head_dim():
    """Block size 8 (what small tests use) and a head size that is not a power of 2."""
    got, ref, *_ = run_both([(9, 1), (0, 11), (5, 13)], block_size=8, heads=3, kv_heads=1,
                            head_dim=40)
    assert_close(got, ref, torch.float32)


def test_split_plan():
    # one long sequence on a GPU of 132 SMs: many splits, none under 256 keys
    assert split_plan(1, 8, 8192, 264, 256, 32) == (32, 256)
    # a full batch needs no split
    assert split_plan(256, 8, 8192, 264, 256, 32) == (1, 8192)
    # short contexts are never split below the minimum
    assert split_plan(1, 8, 300, 264, 256, 32) == (2, 160)
    splits, per = split_plan(3, 2, 1000, 1 << 20, 64, 32)
    assert per % 32 == 0 and (splits - 1) * per < 1000 <= splits * per


def test_padding_slots_write_nothing():
    from folio.kernels.triton_attention import store_kv
    cache = torch.zeros(2, 4, 8, 2, 16, device=DEVICE)
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    store_kv(k, v, cache[0], cache[1], torch.tensor([5, -1, 30], device=DEVICE))
    flat = cache.view(2, -1, 2, 16)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 30], v[2])
    assert flat.abs().sum(dim=(2, 3)).count_nonzero() == 4    # two slots, keys and values


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 1000])
@pytest.mark.parametrize("backend", [TritonAttentionBackend, ForcedSplits])
def test_sliding_window(window, backend):
    """Gemma 3's local layers: each query sees its last `window` keys, against
    the torch backend's window; decodes (split or not), a whole prompt longer
    than the window, chunks resuming mid-prompt, windows inside one block and
    past every context."""
    seqs = [(100, 1), (40, 1), (3, 1), (0, 37), (45, 20), (16, 16)]
    rng = np.random.default_rng(window)
    block_size, heads, kv_heads, head_dim = 8, 4, 2, 32
    num_blocks = sum(-(-(s + n) // block_size) for s, n in seqs) + 3
    step = make_step(seqs, block_size, num_blocks, rng)
    g = torch.Generator().manual_seed(window)
    T = len(step.slot_mapping)
    q = torch.randn(T, heads, head_dim, generator=g).to(DEVICE)
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g).to(DEVICE) for _ in range(2))
    shape = TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=g).to(DEVICE)
    scale = head_dim ** -0.5
    ref = TorchAttentionBackend(heads, kv_heads, head_dim, scale, sliding_window=window).forward(
        q, k, v, cache.clone(), TorchAttentionBackend.build_metadata(step))
    got = backend(heads, kv_heads, head_dim, scale, sliding_window=window).forward(
        q, k, v, cache.clone(), backend.build_metadata(step))
    assert_close(got, ref, torch.float32)
    if window < 37:       # the window changed the answer: the global layer's differs
        full = backend(heads, kv_heads, head_dim, scale).forward(
            q, k, v, cache.clone(), backend.build_metadata(step))
        assert (full - got).abs().max() > 1e-3


# The decode kernel on its own, against a direct torch reference: GQA ratios,
# head sizes and page sizes, one program per (sequence, KV head) or split.

INTERPRETING = not CUDA


def reference_decode(q, cache, tables, ctx_lens, scale, window=0, softcap=0.0):
    """q [S, H, D], cache [2, blocks, bs, Hkv, D] -> [S, H, D] in fp32."""
    S, H, D = q.shape
    bs, hkv = cache.shape[2], cache.shape[3]
    out = torch.empty(S, H, D)
    for s in range(S):
        ctx = int(ctx_lens[s])
        lo = max(ctx - window, 0) if window else 0
        pos = torch.arange(lo, ctx)
        rows = tables[s, pos // bs].cpu() * bs + pos % bs
        k = cache[0].flatten(0, 1)[rows].float().cpu()            # [n, Hkv, D]
        v = cache[1].flatten(0, 1)[rows].float().cpu()
        k = k.repeat_interleave(H // hkv, dim=1)
        v = v.repeat_interleave(H // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float().cpu(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out


def decode_case(ctxs, *, kv_heads, group, head_dim, block_size, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(need) + 2
    free = list(rng.permutation(num_blocks))
    tables = torch.zeros(len(ctxs), max(need), dtype=torch.int64)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([int(free.pop()) for _ in range(n)])
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(ctxs), kv_heads * group, head_dim, generator=g).to(dtype)
    return (q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE),
            torch.tensor(ctxs, dtype=torch.int64, device=DEVICE))


def run_decode(q, cache, tables, ctx_lens, *, per=None, block_n=32, cover=0, **kw):
    """Splits of `per` keys covering the longest context (+ `cover`); one when None."""
    from folio.kernels import triton_attention as tk
    out = torch.empty_like(q)
    keys = int(ctx_lens.max()) + cover
    per = per or max(keys, 1)
    splits = -(-keys // per)
    tk.paged_decode(q, cache[0], cache[1], tables, ctx_lens, q.shape[-1] ** -0.5, out, splits,
                    per, block_n, dot_fp32=INTERPRETING, **kw)
    return out


@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_kernel_gqa_head_and_page_sizes(group, head_dim, block_size):
    """GQA ratios 1, 4 and 8, head sizes 64, 128 and 256, pages smaller than a
    tile of keys (several pages a tile), equal to it and larger (several
    tiles a page): contexts of 1 key, a page's end and across pages; one
    program per (sequence, KV head), then splits of 32 keys and a combine."""
    ctxs = [1, block_size, 2 * block_size + 3, 70]
    q, cache, tables, ctx_lens = decode_case(ctxs, kv_heads=2, group=group,
                                             head_dim=head_dim, block_size=block_size)
    ref = reference_decode(q, cache, tables, ctx_lens, head_dim ** -0.5)
    whole = run_decode(q, cache, tables, ctx_lens)
    assert_close(whole.cpu(), ref, torch.float32)
    split = run_decode(q, cache, tables, ctx_lens, per=32)
    assert_close(split.cpu(), ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_half_precision(dtype, splits):
    q, cache, tables, ctx_lens = decode_case([5, 33, 100], kv_heads=2, group=4, head_dim=128,
                                             block_size=16, dtype=dtype, seed=3)
    got = run_decode(q, cache, tables, ctx_lens, per=32 if splits > 1 else None)
    assert got.dtype == dtype
    assert_close(got.cpu(), reference_decode(q, cache, tables, ctx_lens, 128 ** -0.5), dtype)


@pytest.mark.parametrize("window", [1, 7, 16, 40, 500])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_window_starts_mid_tile(window, splits):
    """A window's first key inside a tile (and a page): the keys before it in
    that tile are masked, and the splits cover window + a tile."""
    q, cache, tables, ctx_lens = decode_case([3, 45, 130, 77], kv_heads=1, group=4,
                                             head_dim=64, block_size=8, seed=window)
    ref = reference_decode(q, cache, tables, ctx_lens, 64 ** -0.5, window=window)
    per = 32 if splits > 1 else None
    got = run_decode(q, cache, tables, ctx_lens, per=per, window=window, cover=32)
    assert_close(got.cpu(), ref, torch.float32)
    if window < 40:
        full = reference_decode(q, cache, tables, ctx_lens, 64 ** -0.5)
        assert (full - got.cpu()).abs().max() > 1e-3


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_kernel_softcap(splits):
    """Soft-capped scores (softcap * tanh(s / softcap)): equal to the capped
    reference, and not to the uncapped one."""
    q, cache, tables, ctx_lens = decode_case([20, 64, 90], kv_heads=2, group=2, head_dim=64,
                                             block_size=16, seed=9)
    q = q * 8                              # scores large enough for the cap to matter
    ref = reference_decode(q, cache, tables, ctx_lens, 64 ** -0.5, softcap=5.0)
    got = run_decode(q, cache, tables, ctx_lens, per=32 if splits > 1 else None, softcap=5.0)
    assert_close(got.cpu(), ref, torch.float32)
    plain = reference_decode(q, cache, tables, ctx_lens, 64 ** -0.5)
    assert (plain - got.cpu()).abs().max() > 1e-2


def test_decode_kernel_block_size_not_a_power_of_two():
    q, cache, tables, ctx_lens = decode_case([1, 12, 40], kv_heads=2, group=3, head_dim=40,
                                             block_size=12)
    ref = reference_decode(q, cache, tables, ctx_lens, 40 ** -0.5)
    assert_close(run_decode(q, cache, tables, ctx_lens).cpu(), ref, torch.float32)
    assert_close(run_decode(q, cache, tables, ctx_lens, per=32).cpu(), ref,
                 torch.float32)


def test_tile_pages():
    from folio.kernels.triton_attention import tile_pages
    assert tile_pages(8, 32) == 4 and tile_pages(32, 32) == 1 and tile_pages(128, 32) == 1
    assert tile_pages(12, 32) == 0


@pytest.mark.parametrize("block_size", [12, 64])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 1, 256), (4, 4, 64)])
def test_prefill_pages_larger_than_a_tile_and_odd_pages(block_size, heads, kv_heads, head_dim):
    """Prompt chunks over pages of several tiles each and over pages whose size
    is not a power of 2, with decodes beside them, GQA 8 at head size 256 and
    MHA at 64."""
    seqs = [(70, 1), (0, 1), (0, 40), (65, 30), (130, 3)]
    got, ref, *_ = run_both(seqs, block_size=block_size, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim)
    assert_close(got, ref, torch.float32)


class TwoLaunches(TritonAttentionBackend):
    """A mixed step as a decode launch and a prefill launch."""
    mixed_launch = False


def _mixed_step(seqs, window, dtype, backend, heads=8, kv_heads=2, head_dim=64,
                block_size=16):
    """(backend's answer, the torch backend's in fp32) on one random step."""
    rng = np.random.default_rng(window)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in seqs) + 3
    step = make_step(seqs, block_size, num_blocks, rng)
    g = torch.Generator().manual_seed(window)
    T = len(step.slot_mapping)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
            for _ in range(2))
    shape = TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    scale, w = head_dim ** -0.5, window or None
    ref = TorchAttentionBackend(heads, kv_heads, head_dim, scale, sliding_window=w).forward(
        q.float(), k.float(), v.float(), cache.float(), TorchAttentionBackend.build_metadata(step))
    got = backend(heads, kv_heads, head_dim, scale, sliding_window=w).forward(
        q, k, v, cache.clone(), backend.build_metadata(step))
    return got, ref


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_in_one_launch(dtype, window, monkeypatch):
    """Decodes and prompt chunks (a whole prompt, a chunk resuming mid-prompt)
    in one launch: the torch backend's answer, and the two-launch answer
    exactly (the same programs, started together)."""
    from folio.kernels import triton_attention as tk
    seqs = [(70, 1), (3, 1), (200, 1), (0, 21), (33, 18)]
    launches = []
    real = tk.paged_mixed
    monkeypatch.setattr(tk, "paged_mixed", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    got, ref = _mixed_step(seqs, window, dtype, TritonAttentionBackend)
    two, _ = _mixed_step(seqs, window, dtype, TwoLaunches)
    assert launches == [1]                      # TwoLaunches never took it
    assert_close(got, ref, dtype)
    assert torch.equal(got, two)
