"""The Triton grouped LoRA kernels (model/lora/triton_lora.py, what adapted
layers run on CUDA) against the per-token torch reference, on the cases of
the native kernel's test: random ranks and slots, runs of many rows and of few in any order with
rows of no adapter between them, an output width off the tiles, strided
input rows; fp32 and bf16. Here in triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 without a GPU); on a GPU on the device."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra pins it)")

from folio.model.lora.layers import reference_lora
from folio.kernels.triton_lora import add_lora
from folio.kernels.native import lora as native_lora
from tests.model.test_native_lora import _case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_are_the_per_token_reference(dtype):
    for seed, shape in enumerate([(23, 72, 100, 48, 5), (40, 96, 72, 32, 8), (1, 16, 20, 16, 1),
                                     (70, 64, 80, 32, 3, 2)]):
        x, y, at, bt, runs, which = _case(seed, *shape)
        x, y, at, bt = (v.to(dtype) for v in (x, y, at, bt))
        want = y.double() + reference_lora(x.double(), at.transpose(1, 2).double(),
                                           bt.transpose(1, 2).double(), which)
        longest = max(end - start for _, start, end in runs)
        got = add_lora(x.to(DEVICE), y.clone().to(DEVICE), at.to(DEVICE), bt.to(DEVICE),
                       native_lora.runs_tensor(runs).to(DEVICE), longest,
                       dot_fp32=DEVICE == "cpu").cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        else:
            assert torch.allclose(got.double(), want.to(dtype).double(), atol=0.05,
                                  rtol=1 / 64), seed
        untouched = [r for r in range(len(which)) if which[r] is None]
        assert torch.equal(got[untouched], y[untouched])
