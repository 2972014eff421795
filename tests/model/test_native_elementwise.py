"""The fused native element-wise kernels against the torch layers they replace."""

import pytest
import torch
import torch.nn.functional as F

from folio.kernels import native
from folio.model.layers.norm import RMSNorm
from folio.model.layers.rotary import RotaryEmbedding
from tests.model.native_builds import builds, library

pytestmark = [pytest.mark.skipif(native.load() is None, reason="no C compiler here"),
              pytest.mark.threads(2)]

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def _close(got, expected, tol):
    got, expected = got.float(), expected.float()
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
    if tol > 1e-3:     # bf16: the same rounding points, so nearly every value is identical
        # (an underflow counts as identical: silu(-100) * up is ~1e-42 exactly, torch
        # flushes it to 0, the AVX-512 bf16 kernel's clamped exponential leaves ~1e-36)
        same = (got == expected) | ((got.abs() < 1e-30) & (expected.abs() < 1e-30))
        assert same.float().mean() > 0.99


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


@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("tokens,dim", [(1, 128), (5, 64), (300, 128)])   # 300: threaded
def test_head_rmsnorm(build, dtype, tol, tokens, dim):
    """Qwen3's q/k norms: each head of the q (then k) part of a strided qkv row,
    in place, against RMSNorm.norm head by head; the v part is untouched."""
    heads, kv_heads = 4, 2
    g = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(dim, 1e-6, dtype)
    norm.weight.data = torch.rand(dim, generator=g).add(0.5).to(dtype)
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)).to(dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    expected = norm.norm(q)
    rest = qkv[:, heads * dim:].clone()
    assert native.head_rmsnorm_(q, norm.weight, norm.eps, library(build)) is q
    _close(q, expected, tol)
    assert torch.equal(qkv[:, heads * dim:], rest)


@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1536), (9, 1536), (64, 1536), (3, 21)])
def test_silu_mul(build, dtype, tol, rows, d):
    """64 x 1536: the threaded path; d = 21: vectors and a scalar tail. Gates
    of +-100 reach the exponential's overflow and underflow."""
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * d, generator=g))
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 89.0, -89.0])
    gate_up[0, d - 2:d] = torch.tensor([-100.0, 100.0])   # a scalar tail where d = 21
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(native.silu_mul(gate_up, library(build)), F.silu(gate) * up, tol)


@pytest.mark.parametrize("build", builds())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5000, 49152, 37])
def test_greedy_takes_the_first_maximum_and_its_log_softmax(build, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = 4 * torch.randn(9, vocab, generator=g)
    logits[3, 17] = logits[3, vocab - 5] = 100.0      # a tie: the first index wins
    logits[5, vocab - 1] = 100.0                      # the maximum in the scalar tail
    logits = logits.to(dtype)
    tokens, logprobs = native.greedy(logits, library(build))
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[3] == 17
    assert tokens[5] == vocab - 1
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-5)


def test_only_bf16_on_the_cpu_takes_the_fused_kernels():
    assert native.fuses(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not native.fuses(torch.zeros(2, 2))
