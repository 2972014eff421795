"""Linear layers: the oneDNN-packed bf16 weights give exactly F.linear's result;
the native kernel gives the exact product's bf16 rounding but for a sum's last
bit (its sums run in another order)."""

import platform

import pytest
import torch
import torch.nn.functional as F

from folio.kernels import native
from folio.model.layers.linear import (MergedColumnParallelLinear, RowParallelLinear, linear,
                                       pack_onednn, pack_weight, prepack)

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

# Asked of the same functions the layers ask: oneDNN packs bf16 weights only
# on CPUs with AVX-512 (bw, vl, dq); on AVX2-only CPUs nothing is packed.
_PROBE = torch.zeros(16, 16).bfloat16()
needs_onednn = pytest.mark.skipif(pack_onednn(_PROBE) is None,
                                  reason="oneDNN packs no bf16 weight on this CPU or torch "
                                         "build (it needs AVX-512)")
needs_native = pytest.mark.skipif(not native.has_bf16_linear(),
                                  reason="no AVX512-BF16 kernel on this machine")


@pytest.fixture(autouse=True)
def _native_even_with_amx(monkeypatch):
    """On an AMX CPU the engine keeps oneDNN for bf16 (prefers_onednn_bf16); the
    AVX512-BF16 kernel it also has is tested all the same."""
    monkeypatch.setattr(native, "prefers_onednn_bf16", lambda: False)


def assert_rounded_product(got, x, w, b=None):
    """got (bf16) is x W^T + b computed exactly then rounded once to bf16, up to
    an fp32 sum's error: within half a bf16 unit in the last place plus
    K * 2^-24 * sum |x_i w_i| of the exact value, and equal to its rounding
    almost everywhere."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    bound = exact.abs() * 2 ** -8 + x.shape[-1] * 2 ** -24 * F.linear(x.double().abs(),
                                                                      w.double().abs())
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert float((got != exact.bfloat16()).float().mean()) < 0.01


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_is_bit_identical(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = pack_onednn(w)
    assert packed is not None and not packed.native
    assert torch.equal(linear(x, w, packed, b), F.linear(x, w, b))


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (40, 576), (1000, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_bf16_is_the_exact_product_rounded(rows, shape, with_bias):
    """Against the fp32 product of the same bf16 values rounded once to bf16:
    output sizes that are not a multiple of the 16-wide tiles, every row-block
    remainder, and a bias added before the rounding."""
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    packed = pack_weight(w)
    assert packed is not None and packed.native
    assert_rounded_product(linear(x, w, packed, b), x, w, b)


@needs_native
def test_native_bf16_reads_strided_rows_and_leading_dimensions():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=g).bfloat16()
    wide = torch.randn(2, 5, 96, generator=g).bfloat16()
    x = wide[..., 16:48]                      # rows 96 apart, each row dense
    packed = pack_weight(w)
    got = linear(x, w, packed)
    assert got.shape == (2, 5, 48) and got.is_contiguous()
    assert_rounded_product(got, x, w)
    assert linear(x[:0], w, packed).shape == (0, 5, 48)


def test_only_bf16_on_cpu_is_packed():
    assert pack_weight(torch.randn(8, 8)) is None                       # fp32: MKL, unchanged
    assert pack_weight(torch.randn(8, 8).half()) is None


def test_prepacked_layers_answer_as_before_and_drop_the_plain_weight():
    """Where this CPU packs bf16 weights (the native kernel or oneDNN), the
    layers hold only the packed copy; where it packs none, they keep theirs."""
    torch.manual_seed(0)
    mlp = torch.nn.ModuleDict({
        "up": MergedColumnParallelLinear(64, [32, 32], False, torch.bfloat16),
        "down": RowParallelLinear(32, 64, True, torch.bfloat16)})
    for layer in mlp.values():
        layer.weight.data.normal_()
        if layer.bias is not None:
            layer.bias.data.normal_()
    x = torch.randn(7, 64).bfloat16()
    before = mlp["down"](mlp["up"](x)[:, :32])
    prepack(mlp)
    if pack_weight(_PROBE) is None:
        assert all(layer.packed is None and layer.weight.numel() > 0 for layer in mlp.values())
    else:
        assert all(layer.packed is not None and layer.weight.numel() == 0
                   for layer in mlp.values())
    after = mlp["down"](mlp["up"](x)[:, :32])
    if mlp["down"].packed is not None and mlp["down"].packed.native:
        # another summation order: the last bit may move
        assert torch.allclose(after.float(), before.float(), rtol=2 ** -7, atol=1e-2)
    else:
        assert torch.equal(after, before)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or native.load() is None,
                    reason="the portable build flag is x86-specific; needs a C compiler")
def test_a_build_without_avx512_compiles_and_offers_no_linear_kernel():
    """Every source, the one-call decoder's too, builds for CPUs without
    AVX-512; such a library declines the linear layer (oneDNN or torch then)."""
    lib = native._build(("-mno-avx512f",))
    assert lib is not None and lib.folio_linear_available() == 0


def test_an_amx_cpu_keeps_onednn_only_where_the_kernel_has_no_amx_path(monkeypatch):
    """The engine's own choice (the fixture above set aside): the native kernel
    where it builds, on AMX CPUs too when it multiplies on the tiles itself
    (else oneDNN, which does)."""
    monkeypatch.undo()
    amx = "amx_bf16" in native._cpu_flags().split()
    if amx and native.has_bf16_linear():        # built here with -march=native: it has it
        assert native.has_amx_linear()
    elif not amx:
        assert not native.has_amx_linear()
    assert native.prefers_onednn_bf16() == (amx and not native.has_amx_linear())
    packed = pack_weight(torch.randn(32, 64).bfloat16())
    assert getattr(packed, "native", False) == (native.has_bf16_linear()
                                                and not native.prefers_onednn_bf16())
