"""The native CPU decode kernel against the torch backend's gathered decode path."""

import platform

import pytest
import torch

from folio.model import native
from folio.model.attention.metadata import AttentionMetadata
from folio.model.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here")


def _portable():
    """The same source built without AVX-512: the portable C path."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the portable build flag is x86-specific")
    lib = native._build(("-mno-avx512f",))
    if lib is None:
        pytest.skip("no C compiler here")
    return lib


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,block_size,dim", [
    (9, 3, 16, 64),       # the default model
    (4, 4, 4, 64),
    (8, 1, 8, 64),
    (8, 8, 32, 128),      # blocks of two 16-row chunks; heads split across tasks
    (16, 1, 16, 128),     # a query group too large for the vector task's registers
    (6, 2, 16, 48)])
def test_kernel_matches_gathered_attention(build, dtype, tol, heads, kv_heads, block_size, dim):
    lib = _portable() if build == "portable" else None
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    batch = 7
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 5 * block_size, 700])
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
    meta = AttentionMetadata(slot_mapping=None, num_decodes=batch, decode_block_tables=tables,
                             decode_context_lens=lens)
    expected = backend._decode(q, kv[0], kv[1], meta).float()
    got = native.paged_decode(q, kv, tables, lens, dim ** -0.5, lib).float()
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
