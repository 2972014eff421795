"""The native CPU attention kernel against the torch backend's paths: decodes
(gathered decode) and mixed steps with prefill chunks (SDPA), in every build
this machine runs (its own, AVX2, portable C), over fp32, bf16 and 8-bit
(int8 rows with their scales) caches."""

import pytest
import torch

from folio.kernels import native
from folio.model.attention import kv_quant
from folio.model.attention.metadata import AttentionMetadata, PrefillSpan
from folio.model.attention.torch_backend import TorchAttentionBackend
from tests.model.native_builds import builds, library

pytestmark = [pytest.mark.skipif(native.load() is None, reason="no C compiler here"),
              pytest.mark.threads(2)]

# (queries, cache, tolerance): a float32 run's cache may be bfloat16
# (--kv-cache-dtype), read widened: the torch backend widens the same cache,
# so only the order of fp32 sums differs
DTYPES = [(torch.float32, torch.float32, 1e-5), (torch.float32, torch.bfloat16, 1e-5),
          (torch.bfloat16, torch.bfloat16, 2e-2), (torch.float32, torch.int8, 1e-5),
          (torch.bfloat16, torch.int8, 2e-2), (torch.float32, torch.uint8, 1e-5),
          (torch.bfloat16, torch.uint8, 2e-2)]    # int8 and fp8 (uint8) rows with scales


def _cache(g, num_blocks, block_size, kv_heads, dim, kv_dtype):
    """A random cache of keys and values in `kv_dtype` (int8, fp8 as uint8:
    each row's steps and scale, attention/kv_quant.py)."""
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g)
    return kv_quant.stored(kv, kv_dtype)


@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [
    (9, 3, 16, 64),       # the default model
    (4, 4, 4, 64),
    (8, 1, 8, 64),
    (8, 8, 32, 128),      # blocks of two 16-row chunks; heads split across tasks
    (16, 1, 16, 128),     # a query group too large for the vector task's registers
    (6, 2, 16, 48),
    (4, 2, 16, 40),       # a multiple of 8, not of 16: AVX2 tiles, AVX-512's portable path
    (4, 2, 16, 256)])     # the largest head the tiles take (bf16 dot products overran here)
def test_kernel_matches_gathered_attention(build, dtype, kv_dtype, tol, heads, kv_heads,
                                          block_size, dim):
    lib = library(build)
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 5 * block_size, 700])
    q, kv, tables, expected = _decodes(g, dtype, kv_dtype, heads, kv_heads, block_size, dim,
                                       lens)
    rows = torch.arange(len(lens))                  # one decode token a sequence
    got = native.paged_attention(q, kv, tables, rows, lens, dim ** -0.5, lib).float()
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()


def _decodes(g, dtype, kv_dtype, heads, kv_heads, block_size, dim, lens):
    """One decode token a sequence of context `lens`, the blocks shuffled: q,
    the KV cache, the block tables and the torch backend's answer."""
    batch, width = len(lens), int((lens.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 3
    kv = _cache(g, num_blocks, block_size, kv_heads, dim, kv_dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
    meta = AttentionMetadata(slot_mapping=None, num_decodes=batch, decode_block_tables=tables,
                             decode_context_lens=lens)
    return q, kv, tables, backend._decode(q, kv[0], kv[1], meta).float()


@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [(9, 3, 16, 64), (8, 1, 8, 64),
                                                           (8, 8, 32, 128), (4, 2, 16, 40)])
@pytest.mark.parametrize("lens", [[700], [1000, 3], [70, 64]])
def test_few_decodes_split_their_context_across_the_threads(build, dtype, kv_dtype, tol, heads,
                                                            kv_heads, block_size, dim, lens):
    """One or two decodes on 2 threads, splits on (FOLIO_ATTENTION_SPLITS=1):
    fewer (token, KV head) tasks than 4 a thread, so the vector path splits
    each context into shares of blocks and merges their partial softmax sums;
    a share may hold no key of the shorter sequence (1000 and 3), or the
    context may end on a block's edge (64). Splits off (the default), the
    same answer; and a decode's row is then bit for bit the one it has in a
    bigger batch, where nothing would split."""
    lib = library(build)
    g = torch.Generator().manual_seed(sum(lens) + dim)
    lens = torch.tensor(lens)
    q, kv, tables, expected = _decodes(g, dtype, kv_dtype, heads, kv_heads, block_size, dim,
                                       lens)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    n = len(lens)
    try:
        with native.attention_splits(lib):
            got = native.paged_attention(q, kv, tables, torch.arange(n), lens,
                                         dim ** -0.5, lib).float()
        unsplit = native.paged_attention(q, kv, tables, torch.arange(n), lens, dim ** -0.5,
                                         lib)
        # the same decodes among 15 copies of the first: 16 x KV heads tasks
        many = native.paged_attention(torch.cat([q] + [q[:1]] * 15), kv,
                                      torch.cat([tables] + [tables[:1]] * 15),
                                      torch.arange(n + 15),
                                      torch.cat([lens] + [lens[:1]] * 15), dim ** -0.5, lib)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
    assert torch.allclose(unsplit.float(), expected, atol=tol, rtol=tol)
    assert torch.equal(many[:n], unsplit)


@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [(9, 3, 16, 64), (8, 8, 32, 128),
                                                           (4, 2, 8, 48)])
def test_one_call_serves_decodes_and_prefill_chunks(build, dtype, kv_dtype, tol, heads, kv_heads,
                                                    block_size, dim):
    """A step of 2 decodes, a whole 40-token prompt and a 23-token chunk that
    resumes at position 37: the kernel against the torch backend's own paths
    (gathered decode, SDPA per prefill span), token for token."""
    lib = library(build)
    g = torch.Generator().manual_seed(heads + dim)
    seqs = [(0, 1, 70), (0, 1, 5), (0, 40, 0), (1, 23, 37)]   # (kind, tokens, start)
    width = max(-(-(n + s) // block_size) for _, n, s in seqs)
    num_blocks = len(seqs) * width + 2
    kv = _cache(g, num_blocks, block_size, kv_heads, dim, kv_dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(seqs) * width].view(len(seqs), width)
    rows, lens, spans, start = [], [], [], 0
    for i, (_, n, s) in enumerate(seqs):
        rows += [i] * n
        lens += list(range(s + 1, s + n + 1))
        if n > 1:
            spans.append(PrefillSpan(start, n, s, tables[i]))
        start += n
    q = torch.randn(start, heads, dim, generator=g).to(dtype)
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
    meta = AttentionMetadata(slot_mapping=None, num_decodes=2, decode_block_tables=tables[:2],
                             decode_context_lens=torch.tensor(lens[:2]))
    expected = torch.cat([backend._decode(q[:2], kv[0], kv[1], meta)] + [
        backend._prefill(q[sp.token_start:sp.token_start + sp.num_tokens],
                         *_span_keys(kv, sp, dtype), kv[0], kv[1], sp) for sp in spans]).float()
    got = native.paged_attention(q, kv, tables, torch.tensor(rows), torch.tensor(lens),
                                 dim ** -0.5, lib).float()
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()


def _span_keys(kv, span, dtype):
    """The chunk's own keys and values, as the backend receives them (an 8-bit
    cache's dequantized to the queries' dtype: they round back to its steps)."""
    read = (lambda x: kv_quant.read(x, dtype)) if kv_quant.is_quantized(kv) else (lambda x: x)
    flat_k = read(kv[0][span.block_table].flatten(0, 1))
    flat_v = read(kv[1][span.block_table].flatten(0, 1))
    rows = slice(span.start_pos, span.start_pos + span.num_tokens)
    return flat_k[rows], flat_v[rows]
