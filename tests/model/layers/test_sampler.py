"""The sampler on fixed distributions: filters never leak, frequencies match the
filtered distribution, each logit adjustment is exactly as defined."""

import math

import numpy as np
import pytest
import torch

from folio.model.layers import draws
from folio.model.layers.sampler import LogitAdjustments, SamplingBatch, apply_adjustments, sample
from tests.model.native_builds import builds, library

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
ROWS = 4000


def batch_of(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=0, **kw):
    vocab = PROBS.numel()
    return SamplingBatch(
        temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k or vocab),
        top_p=torch.full((rows,), top_p),
        keys=draws.keys_tensor(range(seed0, seed0 + rows), [7] * rows, draws.SAMPLE),
        random=np.ones(rows, dtype=bool), all_greedy=False,
        needs_top_k=bool(top_k), needs_top_p=top_p < 1.0,
        min_p=torch.full((rows,), min_p) if min_p else None, **kw)


def draw(**kw) -> torch.Tensor:
    logits = PROBS.log().expand(ROWS, -1).clone()
    return sample(logits, batch_of(ROWS, **kw)).tokens


def check_frequencies(tokens, allowed):
    expected = PROBS.clone()
    expected[[i for i in range(PROBS.numel()) if i not in allowed]] = 0
    expected /= expected.sum()
    counts = torch.bincount(tokens, minlength=PROBS.numel()).float() / ROWS
    sigma = (expected * (1 - expected) / ROWS).sqrt()
    assert set(tokens.unique().tolist()) <= set(allowed)
    assert torch.all((counts - expected).abs() <= 5 * sigma + 1e-9), (counts, expected)


def test_plain_sampling_follows_the_distribution():
    check_frequencies(draw(), range(7))


def test_top_k():
    check_frequencies(draw(top_k=3), [0, 1, 2])


def test_top_p():
    # mass before token i: 0, .40, .65, .80 -> p = 0.7 keeps tokens 0, 1, 2
    check_frequencies(draw(top_p=0.7), [0, 1, 2])


def test_min_p():
    # min_p 0.3 x top 0.40 = 0.12: keeps tokens 0, 1, 2
    check_frequencies(draw(min_p=0.3), [0, 1, 2])


def test_temperature_sharpens():
    cold = torch.bincount(draw(temperature=0.25), minlength=7).float() / ROWS
    assert cold[0] > 0.8


def test_seeded_rows_are_batch_independent():
    logits = PROBS.log().expand(8, -1).clone()
    full = sample(logits, batch_of(8, seed0=100)).tokens
    for i in range(8):
        alone = sample(logits[i:i + 1], batch_of(1, seed0=100 + i)).tokens
        assert alone.item() == full[i].item()


def adjustments(**over):
    base = dict(presence=torch.tensor([0.0]), frequency=torch.tensor([0.0]),
                repetition=torch.tensor([1.0]), output_counts=torch.zeros(1, 4),
                seen=torch.zeros(1, 4, dtype=torch.bool), bias=None, banned=None)
    base.update(over)
    return LogitAdjustments(**base)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0]])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    seen = torch.tensor([[True, True, False, False]])
    out = apply_adjustments(LOGITS, adjustments(repetition=torch.tensor([2.0]), seen=seen))
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_frequency_and_presence_penalties():
    counts = torch.tensor([[0.0, 3.0, 1.0, 0.0]])
    out = apply_adjustments(LOGITS, adjustments(frequency=torch.tensor([0.5]),
                                                presence=torch.tensor([0.25]),
                                                output_counts=counts))
    assert out[0].tolist() == pytest.approx([2.0, -1.0 - 1.5 - 0.25, 0.5 - 0.5 - 0.25, 3.0])


def test_logit_bias_and_ban():
    out = apply_adjustments(LOGITS, adjustments(
        bias=torch.tensor([[0.0, 10.0, 0.0, 0.0]]),
        banned=torch.tensor([[False, False, False, True]])))
    assert out[0, :3].tolist() == [2.0, 9.0, 0.5] and math.isinf(out[0, 3].item())


def test_greedy_rows_use_adjusted_logits_but_report_raw_logprobs():
    b = SamplingBatch(torch.zeros(1), torch.tensor([4]), torch.ones(1), None,
                      np.zeros(1, dtype=bool), True, False, False, adjust=adjustments(bias=torch.tensor([[0.0, 10.0, 0.0, 0.0]])))
    out = sample(LOGITS.clone(), b)
    assert out.tokens.item() == 1
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(LOGITS, -1)[0, 1].item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native_on", [True, False])
def test_greedy_batch_takes_the_first_maximum_and_its_raw_logprob(monkeypatch, native_on, dtype):
    from folio.kernels import native
    if native_on and native.load() is None:
        pytest.skip("no C compiler here")
    if not native_on:
        monkeypatch.setattr(native, "supports", lambda x: False)
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(33, 5000, generator=g)
    logits[3, 17] = logits[3, 4000] = 100.0          # a tie: the first index wins
    logits = logits.to(dtype)                        # bf16: what the LM head hands over
    rows = logits.shape[0]
    batch = SamplingBatch(temperature=torch.zeros(rows), top_k=torch.full((rows,), 5000),
                          top_p=torch.ones(rows), keys=None, random=np.zeros(rows, dtype=bool),
                          all_greedy=True,
                          needs_top_k=False, needs_top_p=False)
    out = sample(logits, batch)
    assert torch.equal(out.tokens, logits.argmax(dim=-1)) and out.tokens[3] == 17
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, out.tokens[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs, expected, atol=1e-5)


def _exact_boundary_gap(logits, top_k, top_p, kept):
    """For each token one of two answers keeps and the other drops: how far
    the exact (float64) mass before it lies from p (0 where only top-k
    decides)."""
    x = logits.double()
    if top_k is not None:
        kth = x.sort(descending=True).values[min(int(top_k), x.numel()) - 1]
        x = torch.where(x >= kth, x, torch.tensor(float("-inf"), dtype=torch.float64))
    p = torch.softmax(x, -1)
    sp, order = p.sort(descending=True)
    before = torch.empty_like(p)
    before[order] = sp.cumsum(0) - sp
    return (before[kept] - float(top_p)).abs() if top_p is not None else before[kept] * 0 + 1


@pytest.mark.parametrize("flags", builds())
def test_native_top_k_top_p_keeps_what_the_sort_keeps(flags):
    """Without a sort, the same tokens as the torch definition, except where
    a token's mass-before lies within float rounding of p (the two sum in
    different orders: then the float64 mass decides, and may go either way)."""
    from folio.kernels import native
    from folio.model.layers.sampler import top_k_top_p_reference
    lib = library(flags)
    g = torch.Generator().manual_seed(0)
    for vocab in (7, 100, 4096, 49152):
        x = 3 * torch.randn(24, vocab, generator=g)
        k = torch.randint(1, vocab + 5, (24,), generator=g)
        p = torch.rand(24, generator=g) * 0.99 + 0.01
        for top_k, top_p in [(k, None), (None, p), (k, p)]:
            ref = top_k_top_p_reference(x.clone(), top_k, top_p)
            got = native.top_k_top_p_(x.clone(), top_k, top_p, lib=lib)
            assert torch.equal(got[~got.isinf()], x[~got.isinf()])    # kept ones untouched
            for r in range(24):
                differ = ref[r].isinf() != got[r].isinf()
                if differ.any():
                    gap = _exact_boundary_gap(x[r], None if top_k is None else top_k[r],
                                              None if top_p is None else p[r], differ)
                    assert float(gap.max()) < 2e-6, (vocab, r)
    # ties at a boundary all stay; an all -inf row but one token keeps it
    tie = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    got = native.top_k_top_p_(tie.clone(), torch.tensor([2]), None, lib=lib)
    assert got.isinf().tolist() == [[True, False, False, True, False]]
    lone = torch.tensor([[float("-inf"), 2.0, float("-inf")]])
    assert native.top_k_top_p_(lone.clone(), None, torch.tensor([0.5]), lib=lib)[0, 1] == 2.0
