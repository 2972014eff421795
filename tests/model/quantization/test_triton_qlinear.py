"""The Triton weight-only matmul (triton_qlinear.py, what quantized layers run
on CUDA) against the dequantized weight, on the same IntGroups forms as the
CPU kernel's tests: 4 and 8 bits, zero points and offsets, act-order with
groups of unequal length, padded groups, sizes off the tiles, a bias. Here in
triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU);
on a GPU on the device."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra pins it)")

from folio.kernels.triton_qlinear import qlinear
from tests.model.quantization.test_qlinear_kernel import random_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(w):
    return w.to(DEVICE)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group,act_order", [(40, 64, 32, False), (100, 96, -1, True),
                                                 (33, 64, 16, True), (24, 80, 20, False)])
@pytest.mark.parametrize("rows", [1, 17])
def test_fp32_matches_the_dequantized_product(bits, n, k, group, act_order, rows):
    w, _, _ = random_weights(n, k, bits, group, act_order, zeros=not act_order, seed=rows)
    g = torch.Generator().manual_seed(rows + 7)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    exact = F.linear(x.double(), w.dequantize().double(), b.double())
    got = qlinear(x.to(DEVICE), on_device(w), b.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once(dtype):
    w, _, _ = random_weights(48, 128, 4, 32, False, seed=3)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = F.linear(x.double(), w.dequantize().double())
    got = qlinear(x.to(DEVICE), on_device(w), dot_fp32=DEVICE == "cpu").cpu()
    assert got.dtype == dtype and got.shape == (3, 5, 48)
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert ((got.double() - exact).abs() <= tol * exact.abs() + tol).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs a quantized model on CUDA")
def test_a_gptq_checkpoint_on_the_gpu_gives_the_cpu_tokens():
    from pathlib import Path

    from folio import LLM, SamplingParams
    folder = str(Path(__file__).parents[2] / "fixtures" / "quant" / "gptq-w4-g32-descact")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 20, 30, 40] * k} for k in (1, 5)]
    runs = [[o.outputs[0].token_ids for o in LLM(folder, dtype="float32", device=d,
                                                 max_model_len=256).generate(prompts, params)]
            for d in ("cpu", "cuda")]
    assert runs[0] == runs[1]
