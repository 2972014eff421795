"""The Triton weight-only fp8 matmul (triton_fp8.py: fp8 layers on GPUs
without fp8 products, and block scales on any) against the dequantized
weight: channel and block scales, a last partial block, sizes off the tiles,
a bias, half precision. Here in triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU); on a GPU on the device."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra pins it)")

from folio.kernels.triton_fp8 import fp8_linear
from folio.model.layers.quantization import fp8
from tests.model.quantization.test_fp8 import _random_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,block", [(40, 64, 64), (100, 96, 32), (33, 200, 128),
                                       (24, 80, 48)])
@pytest.mark.parametrize("rows", [1, 17])
def test_fp32_matches_the_dequantized_product(n, k, block, rows):
    codes, scales = _random_fp8(n, k, -(-k // block), seed=rows)
    g = torch.Generator().manual_seed(rows + 7)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    exact = F.linear(x.double(), fp8.dequantize(codes, scales, block, torch.float64), b.double())
    got = fp8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), block,
                     b.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


def test_every_code_decodes_to_its_e4m3_value():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7f) != 0x7f].reshape(-1, 1)
    got = fp8_linear(torch.ones(1, 1, device=DEVICE), codes.to(DEVICE),
                     torch.ones(len(codes), 1, device=DEVICE), 1).cpu()
    assert torch.equal(got[0], codes.view(torch.float8_e4m3fn).float()[:, 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once(dtype):
    codes, scales = _random_fp8(48, 256, 2, seed=3)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = F.linear(x.double(), fp8.dequantize(codes, scales, 128, torch.float64))
    got = fp8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), 128,
                     dot_fp32=DEVICE == "cpu").cpu()
    assert got.dtype == dtype and got.shape == (3, 5, 48)
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert ((got.double() - exact).abs() <= tol * exact.abs() + tol).all()
