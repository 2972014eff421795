"""The fused native element-wise kernels against the torch layers they replace."""

import pytest
import torch
import torch.nn.functional as F

from folio.model import native
from folio.model.layers.norm import RMSNorm
from folio.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here")

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def _close(got, expected, tol):
    got, expected = got.float(), expected.float()
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
    if tol > 1e-3:     # bf16: the same rounding points, so nearly every value is identical
        assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])        # 300 x 576: the threaded path
def test_add_rmsnorm(dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    x = (3 * torch.randn(rows, 576, generator=g)).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    expected_sum = x + residual
    expected = norm.norm(expected_sum)
    got, got_sum = native.add_rmsnorm(x, residual.clone(), norm.weight, norm.eps)
    _close(got_sum, expected_sum, 0)
    _close(got, expected, tol)
    alone, same = native.add_rmsnorm(x, None, norm.weight, norm.eps)
    assert same is x
    _close(alone, norm.norm(x), tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 400])
def test_rotary_in_place_on_the_fused_qkv_rows(dtype, tol, tokens):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 9, 3, 64
    rope = RotaryEmbedding(dim, 4096, 10000.0)
    cos, sin = rope(torch.randint(0, 4096, (tokens,), generator=g))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    x1, x2 = qk.float().chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    assert native.rotary_(qk, cos, sin) is qk
    _close(qk, expected, tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)      # v untouched


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 64])           # 64 x 1536: the threaded path
def test_silu_mul(dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(native.silu_mul(gate_up), F.silu(gate) * up, tol)


def test_only_bf16_on_the_cpu_takes_the_fused_kernels():
    assert native.fuses(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not native.fuses(torch.zeros(2, 2))
