"""Sliding-window attention (Gemma 3's local layers) in every backend that runs
it, against a plain reference written here: token t of context c sees the
keys at positions c - window .. c - 1 (transformers: kv_idx > q_idx - window).
Windows of one key, shorter than a block, on a block's edge, between the
contexts and longer than all of them; decodes and prefill chunks in one step;
every build of the native kernel (its own, AVX2, portable C)."""

import pytest
import torch

from folio.kernels import native
from folio.model.attention.metadata import AttentionMetadata, PrefillSpan
from folio.model.attention.torch_backend import TorchAttentionBackend
from tests.model.native_builds import builds, library

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

# (tokens, start) of each sequence: 3 decodes, a whole prompt, two resumed chunks
SEQS = [(1, 69), (1, 4), (1, 16), (40, 0), (23, 37), (17, 15)]
WINDOWS = [1, 3, 8, 16, 17, 30, 64, 1000]


def reference(q, kv, tables, rows, lens, scale, window):
    """Dense attention per token through its block table, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], kv.shape[3]
    group = heads // kv_heads
    for t in range(q.shape[0]):
        c = int(lens[t])
        keys = kv[0][tables[rows[t]]].flatten(0, 1)[:c].double()      # [c, Hkv, D]
        values = kv[1][tables[rows[t]]].flatten(0, 1)[:c].double()
        lo = max(0, c - window) if window else 0
        keys, values = keys[lo:], values[lo:]
        for h in range(heads):
            scores = keys[:, h // group] @ q[t, h].double() * scale
            out[t, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def make_step(g, dtype, heads, kv_heads, block_size, dim, seqs=SEQS, kv_dtype=None):
    """q in `dtype`, the cache in `kv_dtype` (default: the same)."""
    width = max(-(-(n + s) // block_size) for n, s in seqs)
    num_blocks = len(seqs) * width + 2
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype or dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(seqs) * width].view(len(seqs), width)
    rows, lens = [], []
    for i, (n, s) in enumerate(seqs):
        rows += [i] * n
        lens += list(range(s + 1, s + n + 1))
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    return q, kv, tables, torch.tensor(rows), torch.tensor(lens)


@pytest.mark.skipif(native.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype,kv_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                (torch.float32, torch.bfloat16, 1e-5),
                                                (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [
    (4, 2, 16, 64), (8, 1, 4, 64), (4, 4, 8, 128), (4, 2, 16, 40), (6, 2, 16, 48)])
def test_native_kernel_attends_to_the_window(build, dtype, kv_dtype, tol, heads, kv_heads,
                                             block_size, dim):
    """(fp32 queries on a bf16 cache: --kv-cache-dtype bfloat16; the reference
    reads the same bf16 keys.)"""
    lib = library(build)
    g = torch.Generator().manual_seed(heads * 7 + dim + block_size)
    q, kv, tables, rows, lens = make_step(g, dtype, heads, kv_heads, block_size, dim,
                                          kv_dtype=kv_dtype)
    for window in WINDOWS:
        expected = reference(q, kv, tables, rows, lens, dim ** -0.5, window).float()
        got = native.paged_attention(q, kv, tables, rows, lens, dim ** -0.5, lib,
                                     sliding_window=window).float()
        assert torch.allclose(got, expected, atol=tol, rtol=tol), (
            window, (got - expected).abs().max())
    # the window changes the answer where a context is longer than it
    full = native.paged_attention(q, kv, tables, rows, lens, dim ** -0.5, lib).float()
    short = native.paged_attention(q, kv, tables, rows, lens, dim ** -0.5, lib,
                                   sliding_window=8).float()
    assert not torch.allclose(full[lens > 8], short[lens > 8], atol=tol)
    assert torch.allclose(full[lens <= 8], short[lens <= 8], atol=tol)


@pytest.mark.skipif(native.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("lens", [[700], [1000, 3]])
def test_native_few_long_decodes_on_two_threads(build, lens):
    """Few decode tasks on 2 threads (the path that splits a context into
    shares, which a windowed layer does not take)."""
    lib = library(build)
    g = torch.Generator().manual_seed(sum(lens))
    q, kv, tables, rows, ctx = make_step(g, torch.float32, 8, 2, 16, 64,
                                         seqs=[(1, n - 1) for n in lens])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for window in (5, 16, 100, 2000):
            expected = reference(q, kv, tables, rows, ctx, 0.125, window).float()
            got = native.paged_attention(q, kv, tables, rows, ctx, 0.125, lib,
                                         sliding_window=window)
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), window
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_attends_to_the_window(block_size, kv_dtype):
    """TORCH_SDPA's gathered decode and per-span SDPA, masked by the window
    (on a bf16 cache too: fp32 queries read it widened), reading only the
    blocks the window touches."""
    heads, kv_heads, dim = 4, 2, 32
    g = torch.Generator().manual_seed(block_size)
    q, kv, tables, rows, lens = make_step(g, torch.float32, heads, kv_heads, block_size, dim,
                                          kv_dtype=kv_dtype)
    d = sum(1 for n, _ in SEQS if n == 1)
    for window in WINDOWS:
        backend = TorchAttentionBackend(heads, kv_heads, dim, dim ** -0.5, sliding_window=window)
        meta = AttentionMetadata(slot_mapping=None, num_decodes=d,
                                 decode_block_tables=tables[:d], decode_context_lens=lens[:d])
        start = d
        for i, (n, s) in enumerate(SEQS[d:], d):
            meta.prefills.append(PrefillSpan(start, n, s, tables[i]))
            start += n
        k = torch.stack([kv[0][tables[r]].flatten(0, 1)[c - 1] for r, c in zip(rows, lens)])
        v = torch.stack([kv[1][tables[r]].flatten(0, 1)[c - 1] for r, c in zip(rows, lens)])
        got = backend.attend(q, k, v, kv, meta)
        expected = reference(q, kv, tables, rows, lens, dim ** -0.5, window).float()
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), window
        # blocks wholly before every window of their sequence are not read:
        # NaN there (which a masked read would still spread) changes nothing
        poisoned = kv.clone()
        for i, (_, s) in enumerate(SEQS):
            unread = max(0, s + 1 - window) // block_size
            poisoned[:, tables[i, :unread]] = float("nan")
        assert torch.equal(backend.attend(q, k, v, poisoned, meta), got), window


class NoWindows(TorchAttentionBackend):
    """A backend that does not say it runs windows."""
    name = "NO_WINDOWS"
    supports_sliding_window = False


def test_a_backend_without_windows_refuses_a_windowed_layer():
    assert NoWindows(4, 2, 32, 0.1).sliding_window is None
    with pytest.raises(ValueError, match="NO_WINDOWS does not run sliding-window layers "
                                         r"\(window 16\)"):
        NoWindows(4, 2, 32, 0.1, sliding_window=16)
