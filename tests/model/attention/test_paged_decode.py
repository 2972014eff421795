"""The native CPU decode kernel against the torch backend's gathered decode path."""

import pytest
import torch

from folio.model.attention import cpu_kernels
from folio.model.attention.metadata import AttentionMetadata
from folio.model.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(9, 3, 16), (4, 4, 4), (8, 1, 8)])
def test_kernel_matches_gathered_attention(dtype, tol, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    dim, num_blocks, batch = 64, 160, 7
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 5 * block_size, 61])
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
    meta = AttentionMetadata(slot_mapping=None, num_decodes=batch, decode_block_tables=tables,
                             decode_context_lens=lens)
    expected = backend._decode(q, kv[0], kv[1], meta).float()
    got = cpu_kernels.paged_decode(q, kv, tables, lens, dim ** -0.5).float()
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
