"""Sampling's random draws (model/layers/draws.py): uniforms that are
uniform and independent across tokens, rows, positions and streams; the
exponential race picks each token with its probability; and the native CPU
kernel (each build this machine runs) and the Triton kernel (its interpreter
here, CUDA where there is one) draw exactly the torch definition's tokens."""

import math

import numpy as np
import pytest
import torch

from folio.kernels import native
from folio.model.layers import draws
from tests.model.native_builds import builds, library
from tests.utils import triton_device

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)


def test_uniforms_are_uniform_over_tokens_and_rows():
    keys = draws.keys_tensor(range(64), range(64), draws.SAMPLE)
    u = draws.uniforms_reference(keys, 4096)
    assert u.min() > 0 and u.max() < 1
    # 64 bins: chi-square with 63 degrees of freedom, far tail at 120
    counts = torch.bincount((u.flatten() * 64).long(), minlength=64).float()
    expected = u.numel() / 64
    assert ((counts - expected) ** 2 / expected).sum() < 120
    # neighbouring tokens, and the same token in neighbouring rows, uncorrelated
    a = u - 0.5
    assert abs((a[:, 1:] * a[:, :-1]).mean() / a.var()) < 0.02
    assert abs((a[1:] * a[:-1]).mean() / a.var()) < 0.02


def test_keys_differ_by_seed_position_and_stream_and_repeat_exactly():
    base = draws.row_keys([5], [10], draws.SAMPLE)
    assert draws.row_keys([5], [10], draws.SAMPLE)[0] == base[0]
    others = [draws.row_keys([6], [10], draws.SAMPLE), draws.row_keys([5], [11], draws.SAMPLE),
              draws.row_keys([5], [10], draws.ACCEPT), draws.row_keys([-5], [10], draws.SAMPLE)]
    assert len({int(base[0])} | {int(k[0]) for k in others}) == 5
    # seeds of any size: taken mod 2^64
    assert draws.row_keys([5 + (1 << 64)], [10], draws.SAMPLE)[0] == base[0]
    u = [draws.uniform(s, 3, draws.ACCEPT) for s in range(4000)]
    assert 0 <= min(u) and max(u) < 1 and abs(np.mean(u) - 0.5) < 0.02


def test_the_race_picks_each_token_with_its_probability():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02, 0.0])
    rows = 20000
    keys = draws.keys_tensor(range(rows), [3] * rows, draws.SAMPLE)
    tokens = draws.race_reference((probs * 2.5).expand(rows, -1), keys)   # weights, unnormalized
    freq = torch.bincount(tokens, minlength=8).float() / rows
    sigma = (probs * (1 - probs) / rows).sqrt()
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-9), freq
    assert freq[7] == 0


def _cases():
    g = torch.Generator().manual_seed(0)
    peaked = torch.softmax(4 * torch.randn(40, 3001, generator=g), -1)
    flat = torch.softmax(0.1 * torch.randn(9, 50000, generator=g), -1)
    sparse = peaked.clone()
    sparse[sparse < sparse.max(dim=-1, keepdim=True).values * 0.05] = 0   # top-p's zeros
    one = torch.zeros(3, 1000)
    one[:, 999] = 1.0                    # all mass on the last token
    return [peaked, flat, sparse, one]


@pytest.mark.parametrize("flags", builds())
def test_native_race_draws_the_torch_definitions_tokens(flags):
    lib = library(flags)
    for i, probs in enumerate(_cases()):
        keys = draws.keys_tensor(range(100 * i, 100 * i + probs.shape[0]),
                                 range(probs.shape[0]), draws.SAMPLE)
        assert torch.equal(native.race(probs, keys, lib), draws.race_reference(probs, keys))


def test_triton_race_draws_the_torch_definitions_tokens(monkeypatch):
    device = triton_device(monkeypatch)
    from folio.kernels import triton_sampling
    for i, probs in enumerate(_cases()[:1] + [c[:2] for c in _cases()[1:]]):
        keys = draws.keys_tensor(range(100 * i, 100 * i + probs.shape[0]),
                                 range(probs.shape[0]), draws.SAMPLE)
        got = triton_sampling.race(probs.to(device), keys.to(device)).cpu()
        assert torch.equal(got, draws.race_reference(probs, keys))


def test_one_call_draws_what_row_by_row_calls_draw():
    probs = _cases()[0]
    keys = draws.keys_tensor(range(probs.shape[0]), [9] * probs.shape[0], draws.SAMPLE)
    together = draws.race(probs, keys)
    for r in range(0, probs.shape[0], 7):
        assert draws.race(probs[r:r + 1], keys[r:r + 1]).item() == together[r].item()
    assert math.isclose(float(probs.sum()), probs.shape[0], rel_tol=1e-4)
