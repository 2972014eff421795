"""The native grouped LoRA kernel (native/lora.c) against the per-token torch
reference (model/lora/layers.reference_lora), in every build this machine
runs (its own, AVX2, portable C): random ranks and slots, runs of 1 to 9
rows and of a prompt's many, in any order (an adapter's rows in two runs,
rows of no adapter between them), fp32 and bf16 activations and slots, an
output width that is not a whole number of vectors, strided input rows."""

import pytest
import torch

from folio.model.lora.layers import reference_lora
from folio.kernels.native import lora as native_lora
from tests.model.native_builds import builds, library

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)


def _case(seed: int, rows: int, in_features: int, out: int, width: int, slots: int,
          cuts: int = 0):
    """`cuts`: how many places the rows are cut into runs (0: a third of them)."""
    g = torch.Generator().manual_seed(seed)
    at = torch.randn(slots, in_features, width, generator=g) / in_features ** 0.5
    bt = torch.randn(slots, width, out, generator=g)
    for s in range(slots):                  # each slot's own rank: the rest zero
        rank = int(torch.randint(1, width + 1, (1,), generator=g))
        at[s, :, rank:] = 0
    # runs cut from the rows in a random order of pieces, some left to the base
    inner = torch.randint(1, rows, (cuts or rows // 3,), generator=g).tolist() if rows > 1 \
        else []
    cuts = sorted(set(inner) | {0, rows})
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:])]
    order = torch.randperm(len(pieces), generator=g).tolist()
    runs, which = [], [None] * rows
    for i in order:
        if runs and torch.rand(1, generator=g).item() < 0.2:
            continue                          # the base's rows
        slot = int(torch.randint(0, slots, (1,), generator=g))
        start, end = pieces[i]
        runs.append((slot, start, end))
        for r in range(start, end):
            which[r] = slot
    x = torch.randn(rows, in_features + 7, generator=g)[:, 3:3 + in_features]  # strided rows
    y = torch.randn(rows, out, generator=g)
    return x, y, at, bt, runs, which


@pytest.mark.parametrize("flags", builds())
@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])
def test_the_kernel_is_the_per_token_reference(flags, dtype, w_dtype):
    lib = library(flags)
    for seed, shape in enumerate(
            [(23, 72, 100, 48, 5), (9, 64, 128, 16, 2), (40, 96, 72, 32, 8), (1, 16, 20, 16, 1),
             (70, 64, 80, 32, 3, 2)]):          # the last: runs of many rows (prompts)
        x, y, at, bt, runs, which = _case(seed, *shape)
        rows = shape[0]
        x, y, at, bt = x.to(dtype), y.to(dtype), at.to(w_dtype), bt.to(w_dtype)
        want = y.double() + reference_lora(x.double(), at.transpose(1, 2).double(),
                                           bt.transpose(1, 2).double(), which)
        got = native_lora.add_lora(x, y.clone(), at, bt, native_lora.runs_tensor(runs), lib)
        if dtype == torch.float32:
            assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), (seed, flags)
        else:       # y rounded to bf16 once, after the fp32 sum
            assert torch.allclose(got.double(), want.to(dtype).double(), atol=0.05,
                                  rtol=1 / 128), (seed, flags)
        untouched = [r for r in range(rows) if which[r] is None]
        assert torch.equal(got[untouched], y[untouched])


def test_a_width_that_is_not_a_multiple_of_16_is_refused():
    library(None)
    x, y = torch.zeros(2, 8), torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="width 8"):
        native_lora.add_lora(x, y, torch.zeros(1, 8, 8), torch.zeros(1, 8, 8),
                             native_lora.runs_tensor([(0, 0, 2)]))
