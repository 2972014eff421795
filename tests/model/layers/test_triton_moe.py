"""The Triton fused MoE kernel (layers/triton_moe.py, what float experts run
on CUDA) against the per-token reference: expert counts and top-k, one token,
every token on the same experts, experts nobody picks (NaN weights there
change nothing), sizes off the tiles; its alignment of rows into blocks of
one expert each. Here in triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU); on a GPU on the device."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra pins it)")

from folio.model.layers.moe import reference_experts, route  # noqa: E402
from folio.kernels.triton_moe import align_by_expert, triton_fused_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(experts, top_k, tokens, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * i, h, generator=g) * 0.3
    w2 = torch.randn(experts, h, i, generator=g) * 0.3
    x = torch.randn(tokens, h, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True, True)
    return x, w13, w2, weights, ids


def _on(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("experts,top_k,tokens,h,i", [
    (1, 1, 5, 32, 16), (4, 2, 1, 64, 32), (4, 2, 17, 40, 24), (8, 3, 9, 64, 48),
    (16, 4, 50, 32, 16), (5, 5, 7, 48, 40)])
def test_fp32_matches_the_per_token_loop(experts, top_k, tokens, h, i):
    x, w13, w2, weights, ids = _case(experts, top_k, tokens, h, i, experts * 10 + tokens)
    want = reference_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    got = triton_fused_experts(*_on(x, w13, w2, weights, ids)).cpu()
    assert got.dtype == torch.float32 and got.shape == (tokens, h)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_every_token_on_the_same_experts_and_experts_nobody_picks():
    x, w13, w2, _, _ = _case(8, 2, 20, 32, 16, 1)
    ids = torch.tensor([[6, 2]] * 20)
    weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(2))
    want = reference_experts(x, w13, w2, weights, ids)
    w13[[0, 1, 3, 4, 5, 7]] = float("nan")
    w2[[0, 1, 3, 4, 5, 7]] = float("nan")
    got = triton_fused_experts(*_on(x, w13, w2, weights, ids)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_its_rounding(dtype):
    x, w13, w2, weights, ids = _case(8, 2, 12, 64, 32, 5)
    want = reference_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    got = triton_fused_experts(*_on(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids),
                               dot_fp32=DEVICE == "cpu").cpu()
    assert got.dtype == dtype
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert ((got.double() - want).abs() <= tol * want.abs().max()).all()


@pytest.mark.parametrize("tokens,top_k,experts,block", [(1, 2, 4, 16), (17, 2, 4, 16),
                                                        (9, 3, 8, 4), (50, 4, 16, 8)])
def test_rows_are_aligned_in_whole_blocks_of_one_expert(tokens, top_k, experts, block):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    rows, block_expert = align_by_expert(ids, experts, block)
    flat = ids.reshape(-1)
    assert rows.numel() == block_expert.numel() * block
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        chunk = [r for r in rows[b * block:(b + 1) * block].tolist() if r >= 0]
        if e < 0:
            assert not chunk                                # past the last expert's blocks
            continue
        assert all(int(flat[r]) == e for r in chunk)        # one expert per block
        seen += chunk
    assert sorted(seen) == list(range(flat.numel()))        # every row once
    # each expert's rows take ceil(count / block) blocks, no more
    counts = torch.bincount(flat, minlength=experts)
    used = (block_expert >= 0).sum().item()
    assert used == sum(-(-c // block) for c in counts.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs a MoE model on CUDA")
def test_a_moe_model_on_the_gpu_gives_the_cpu_tokens(tmp_path):
    """FusedMoE on CUDA takes the kernel, eagerly and in CUDA graphs."""
    from folio import LLM, SamplingParams
    from tests.utils import make_tiny_model
    path = make_tiny_model(tmp_path / "m", arch="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, head_dim=32)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 20, 30, 40] * k} for k in (1, 5, 9)]
    runs = [[o.outputs[0].token_ids for o in LLM(path, dtype="float32", device=d,
                                                 max_model_len=256).generate(prompts, params)]
            for d in ("cpu", "cuda")]
    assert runs[0] == runs[1]
