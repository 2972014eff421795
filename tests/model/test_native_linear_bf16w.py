"""The AVX2 linear kernel with bf16-stored weights: fp32 in and out, the
weights rounded once to bf16 (as torch rounds) and the products summed in
fp32, so the result is F.linear with those bf16 weights up to an fp32 sum's
error (its sums run in another order)."""

import pytest
import torch
import torch.nn.functional as F

from folio.kernels import native

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

needs_kernel = pytest.mark.skipif(not native.packs_linear_bf16w(torch.zeros(8, 8)),
                                  reason="no AVX2 + FMA kernel on this machine (or no compiler)")


def assert_fp32_sum_of(got, x, w_bf16, b=None):
    exact = F.linear(x.double(), w_bf16.double(), None if b is None else b.double())
    bound = x.shape[-1] * 2 ** -23 * F.linear(x.double().abs(), w_bf16.double().abs()) + 1e-30
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("shape", [(24, 64), (13, 40), (1000, 130), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weights_fp32_sums(rows, shape, with_bias):
    """Output sizes off the 8-wide tiles and the 3-tile groups, every row-block
    remainder, a bias added in fp32."""
    g = torch.Generator().manual_seed(rows * 31 + shape[0])
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g) if with_bias else None
    x = torch.randn(rows, shape[1], generator=g)
    packed = native.pack_linear_bf16w(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-shape[0] // 8), shape[1], 8)
    assert_fp32_sum_of(native.linear_bf16w(x, packed, shape[0], b), x, w.bfloat16(), b)


@needs_kernel
def test_strided_rows_leading_dimensions_and_no_rows():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 32, generator=g)
    wide = torch.randn(2, 3, 80, generator=g)
    x = wide[..., 8:40]                       # rows 80 apart
    packed = native.pack_linear_bf16w(w)
    got = native.linear_bf16w(x, packed, 40)
    assert got.shape == (2, 3, 40) and got.is_contiguous()
    assert_fp32_sum_of(got.reshape(6, 40), x.reshape(6, 32), w.bfloat16())
    assert native.linear_bf16w(x[:0], packed, 40).shape == (0, 3, 40)


@needs_kernel
def test_the_padding_of_the_last_tile_is_never_written_out():
    w = torch.randn(13, 16)
    out = native.linear_bf16w(torch.randn(3, 16), native.pack_linear_bf16w(w), 13)
    assert out.shape == (3, 13) and torch.isfinite(out).all()
