"""The quantized linear kernel (native/qlinear.c) against the torch path it
stands in for: the same IntGroups weights dequantized to fp32 and multiplied.
Its sums run in another order (with few rows per group, then scaled; with
more, on a panel of the tiles dequantized to fp32), so the two agree to an
fp32 sum's error; bf16 activations are widened first and the output
rounded once. Tested in the build this machine runs and in the AVX2 build
(-mno-avx512f), where the CPU can run that one."""

import pytest
import torch
import torch.nn.functional as F

from folio.kernels import native
from folio.model.layers.quantization.int_checkpoint import unpack_int32
from folio.model.layers.quantization.int_groups import IntGroups
from tests.model.native_builds import cpu_has, x86

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

needs_kernel = pytest.mark.skipif(not native.runs_qlinear(torch.zeros(1)),
                                  reason="no AVX2 + FMA + F16C or AVX-512 kernel on this "
                                         "machine (or no compiler)")


def _builds():
    """This machine's build; the AVX2 one; and the AVX2 one without AVX-VNNI
    (vpmaddwd and vpmaddubsw instead of vpdpwssd and vpdpbusd: AVX2 CPUs before
    Alder Lake and Zen 5). Each where it differs from the ones before it: on
    an AVX2 CPU without AVX-VNNI all three are the same library."""
    yield pytest.param(None, id="native")
    avx2 = pytest.mark.skipif(
        not x86() or not cpu_has("avx2", "fma", "f16c"),
        reason="the AVX2 build needs an x86-64 CPU with AVX2, FMA and F16C")
    if not x86() or native.distinct_build(("-mno-avx512f",)):
        yield pytest.param(("-mno-avx512f",), id="avx2", marks=avx2)
    if not x86() or native.distinct_build(("-mno-avxvnni",)):
        yield pytest.param(("-mno-avx512f", "-mno-avxvnni"), id="avx2-no-vnni", marks=avx2)


def random_weights(n, k, bits, group, act_order, zeros=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    size = k if group == -1 else group
    groups = torch.arange(k) // size
    if act_order:
        groups = groups[torch.randperm(k, generator=g)]
    count = -(-k // size)
    scale = (torch.rand(n, count, generator=g) * 0.05 + 0.01).half().float()
    if zeros:
        zero = torch.randint(0, 1 << bits, (n, count), generator=g).float()
        return IntGroups.from_codes(codes, groups, scale, bits, zero=zero), codes, groups
    offset = (torch.randn(n, count, generator=g) * 0.1).half().float()
    return IntGroups.from_codes(codes, groups, scale, bits, offset=offset), codes, groups


@pytest.fixture(scope="module", params=list(_builds()))
def lib(request):
    if request.param is None:
        return native.load()
    return native._build(request.param)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("n,k,group,act_order", [(40, 64, 32, False), (192, 576, 32, False),
                                                 (100, 96, -1, True), (33, 64, 16, True),
                                                 (17, 128, 128, False), (24, 80, 20, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 11, 13, 15])
def test_fp32_matches_the_dequantized_product(lib, bits, n, k, group, act_order, rows):
    """Output sizes off the 16-wide tiles and the 3-tile groups, every row-block
    size of both kernels (up to 3 or 4 rows: group sums; more: the dequantized
    panel, in blocks of 6 (AVX2) or 8 (AVX-512) and their remainders), act-order (input features permuted, groups of unequal length in
    a rank's slice), one group over all inputs, groups of 20 (padded to 24
    positions), a bias added in fp32."""
    w, _, _ = random_weights(n, k, bits, group, act_order, zeros=not act_order, seed=rows)
    g = torch.Generator().manual_seed(rows + 7)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    got = native.qlinear(x, w, b, lib=lib)
    exact = F.linear(x.double(), w.dequantize().double(), b.double())
    bound = 4 * k * 2 ** -23 * F.linear(x.double().abs(), w.dequantize().double().abs()) + 1e-6
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert bool(((got.double() - exact).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [3, 9])        # both float kernels
def test_bf16_activations_widen_and_round_once(lib, bits, rows):
    w, _, _ = random_weights(48, 64, bits, 32, False)
    x = torch.randn(rows, 64).bfloat16()
    got = native.qlinear(x, w, lib=lib)
    exact = F.linear(x.double(), w.dequantize().double())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-5)


@needs_kernel
def test_strided_rows_leading_dimensions_and_no_rows(lib):
    w, _, _ = random_weights(40, 32, 4, 32, False)
    wide = torch.randn(2, 3, 80)
    x = wide[..., 8:40]
    got = native.qlinear(x, w, lib=lib)
    assert got.shape == (2, 3, 40)
    exact = F.linear(x.reshape(6, 32).double(), w.dequantize().double())
    assert torch.allclose(got.reshape(6, 40).double(), exact, rtol=1e-5, atol=1e-5)
    assert native.qlinear(x[:0], w, lib=lib).shape == (0, 3, 40)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [32, 20])
def test_the_packed_form_dequantizes_to_the_formula(bits, act_order, group):
    """w = q * scale + offset (offset = -zero * scale), in the caller's order of
    the input features whatever order the packing keeps them in; groups of 20
    padded to 24 positions (6 bits: to 32, whole pairs of octets)."""
    count = 96 // group + (96 % group > 0)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1 << bits, (37, 96), generator=g)
    groups = torch.arange(96) // group
    if act_order:
        groups = groups[torch.randperm(96, generator=g)]
    scale = (torch.rand(37, count, generator=g) * 0.05 + 0.01).half().float()
    zero = torch.randint(0, 1 << bits, (37, count), generator=g).float()
    w = IntGroups.from_codes(codes, groups, scale, bits, zero=zero)
    expect = (codes.float() - zero[:, groups]) * scale[:, groups]
    assert torch.equal(w.dequantize(), expect)
    assert (w.perm is not None) == (act_order or group == 20)
    lengths = [min(group, 96 - i * group) for i in range(count)]       # 20 x 4 and 16
    unit = 16 if bits == 6 else 8
    assert w.positions == sum(-(-n // unit) * unit for n in lengths)
    per_weight = bits / 8 + 4 / group          # codes; float16 scale and zero per group
    assert w.nbytes <= 48 * w.positions * per_weight + (w.positions * 8 if w.perm is not None
                                                      else 0) + 64


def _two_level_weights(n, k, bits, group, shared, seed=0):
    """Random K-quant-like weights: each scale an int8 times its super-block's
    (256 inputs) float16 d, each offset an int8 (shared: the scale's own) times
    its float16 e."""
    g = torch.Generator().manual_seed(seed)
    per, count = 256 // group, k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    groups = torch.arange(k) // group
    d, e = ((torch.randn(n, count // per, generator=g) * 0.01).half().float()
            .repeat_interleave(per, 1) for _ in range(2))
    sc = torch.randint(-128, 128, (n, count), generator=g).float()
    om = sc if shared else torch.randint(0, 64, (n, count), generator=g).float()
    w = IntGroups.from_codes(codes, groups, sc * d, bits, offset=om * e, supers=(d, e, per))
    return w, codes.float() * (sc * d)[:, groups] + (om * e)[:, groups]


@pytest.mark.parametrize("bits,group,shared", [(4, 32, False), (6, 16, True), (6, 16, False),
                                               (8, 32, False)])
def test_two_level_scales_are_held_as_int8_and_a_float16_pair_a_super_block(bits, group,
                                                                            shared):
    """A K-quant's scales (Q4_K: d sc and -dmin m; Q6_K: d sc and -32 d sc,
    one int8 serving both) are held as the int8s and a float16 pair per 256
    inputs, the values exactly (fp32 products), rows looked up as a whole."""
    w, exact = _two_level_weights(40, 512, bits, group, shared)
    assert w.supers is not None and (w.offsets is None) == shared
    assert w.scales.dtype == torch.int8 and w.supers.shape == (3, 2, 2, 16)
    assert torch.equal(w.dequantize(), exact)
    rows = torch.tensor([[3, 39], [0, 17]])
    assert torch.equal(w.dequantize_rows(rows), exact[rows])
    per_weight = bits / 8 + (1 if shared else 2) / group + 4 / 256
    assert w.nbytes <= 48 * 512 * per_weight + 4 * (512 // group + 1)      # and the bounds
    # values that are not so are held as float16 scales and offsets
    g = torch.arange(512) // group
    s, o = torch.rand(40, 512 // group), torch.rand(40, 512 // group)
    flat = IntGroups.from_codes(torch.zeros(40, 512), g, s, bits, offset=o,
                                supers=(torch.ones_like(s), torch.ones_like(o), 256 // group))
    assert flat.supers is None and flat.scales.dtype == torch.float16


@needs_kernel
@pytest.mark.parametrize("bits,group,shared", [(4, 32, False), (6, 16, True), (6, 32, False)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
def test_two_level_scales_in_every_mode(lib, bits, group, shared, rows):
    """The kernel's two-level scales (an int8 times a float16 per super-block)
    against the exact product: fp32 to an fp32 sum's error, int16 and int8
    activations within their rounding (as above), bf16 to its own."""
    w, dense = _two_level_weights(40, 512, bits, group, shared, seed=rows)
    g = torch.Generator().manual_seed(rows + 3)
    x, b = torch.randn(rows, 512, generator=g), torch.randn(40, generator=g)
    exact = F.linear(x.double(), dense.double(), b.double())
    sums = 4 * 512 * 2 ** -23 * F.linear(x.double().abs(), dense.double().abs()) + 1e-6
    got = native.qlinear(x, w, b, lib=lib)
    assert bool(((got.double() - exact).abs() <= sums).all())
    for mode, steps in ((1, 32767), (2, 127)):
        step = x.abs().max(dim=1, keepdim=True).values.double() / steps
        bound = 0.5 * step * dense.double().abs().sum(1) + sums
        got = native.qlinear(x, w, b, quantize_x=mode, lib=lib)
        assert bool(((got.double() - exact).abs() <= bound).all()), mode
    got = native.qlinear(x.bfloat16(), w, b, lib=lib)
    exact = F.linear(x.bfloat16().double(), dense.double(), b.double())
    assert bool(((got.double() - exact).abs() <= sums + exact.abs() * 2 ** -8).all())


@needs_kernel
@pytest.mark.parametrize("form", ["q4 g32", "q6 g16 shared", "q6 g32", "q8 g32", "q4 g32 flat",
                                  "q6 g16 flat"])
def test_a_rows_int8_product_is_the_same_whatever_the_row_count(lib, form):
    """The int8 path's rows in register blocks of 1-4 rows, the scales held
    or computed (AVX2 without VNNI: K-quant-shaped 4- and 6-bit groups of four
    rows in rows4), one tile or two at a time: each row's output bit for bit
    the same in a call of 1, 2, 4, 5, 9 or 16 rows, so a request's arithmetic
    does not depend on its batch; the int16 path's too."""
    bits, group = int(form[1]), int(form.split()[1][1:])
    if form.endswith("flat"):
        w, _, _ = random_weights(40, 512, bits, group, False, zeros=False, seed=bits)
    else:
        w, _ = _two_level_weights(40, 512, bits, group, "shared" in form, seed=bits)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(group)) * 2
    for mode in (1, 2):         # and the int16 path's (one tile at a time at one row)
        alone = torch.cat([native.qlinear(x[i:i + 1], w, quantize_x=mode, lib=lib)
                           for i in range(16)])
        for rows in (2, 4, 5, 9, 16):
            got = native.qlinear(x[:rows], w, quantize_x=mode, lib=lib)
            assert torch.equal(got, alone[:rows]), (mode, rows)
    # and against the exact product: within the int8 rounding (as above)
    dense = w.dequantize().double()
    step = x.abs().max(dim=1, keepdim=True).values.double() / 127
    bound = 0.5 * step * dense.abs().sum(1) + 4 * 512 * 2 ** -23 * F.linear(
        x.double().abs(), dense.abs()) + 1e-6
    assert bool(((alone.double() - F.linear(x.double(), dense)).abs() <= bound).all())


def test_bad_codes_groups_and_widths_are_refused():
    codes = torch.zeros(4, 8, dtype=torch.int64)
    s = torch.ones(4, 1)
    with pytest.raises(ValueError, match="3-bit weights are not supported"):
        IntGroups.from_codes(codes, torch.zeros(8), s, 3, zero=s)
    with pytest.raises(ValueError, match="out of range for 4 bits"):
        IntGroups.from_codes(codes + 16, torch.zeros(8), s, 4, zero=s)
    with pytest.raises(ValueError, match="group index out of range"):
        IntGroups.from_codes(codes, torch.ones(8), s, 4, zero=s)
    with pytest.raises(ValueError, match="has groups"):
        IntGroups.from_codes(codes, torch.zeros(7), s, 4, zero=s)


def test_unpacking_int32_words_in_both_orders():
    words = torch.tensor([[0x76543210, 0x0FEDCBA9]], dtype=torch.int32)
    assert unpack_int32(words, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7,
                                                  9, 10, 11, 12, 13, 14, 15, 0]]
    # AWQ: the i-th nibble holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    awq = unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), 4, 1,
                       order=[0, 2, 4, 6, 1, 3, 5, 7])
    assert awq.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    signed = torch.tensor([[-1]], dtype=torch.int32)              # every bit set
    assert unpack_int32(signed, 8, 0).tolist() == [[255], [255], [255], [255]]


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("n,k,group,act_order", [(40, 64, 32, False), (192, 576, 32, False),
                                                 (100, 96, -1, True), (33, 80, 20, True)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_int16_activations_stay_within_their_rounding(lib, bits, n, k, group, act_order, rows):
    """quantize_x: x rounded to int16 per block of 32 positions (its scale the
    block's largest |x| / 32767), the codes multiplied as integers. Each x is
    then off by at most half a step, so each output by at most half a step
    times sum |w| over the block, plus fp32 sums. Groups of 20 are padded with
    zero codes to whole octets of positions."""
    w, _, _ = random_weights(n, k, bits, group, act_order, zeros=not act_order, seed=rows)
    g = torch.Generator().manual_seed(rows + 11)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    got = native.qlinear(x, w, b, quantize_x=True, lib=lib)
    dense = w.dequantize().double()
    exact = F.linear(x.double(), dense, b.double())
    step = x.abs().max(dim=1, keepdim=True).values.double() / 32767      # at most a block's
    bound = 0.5 * step * dense.abs().sum(1) + 4 * k * 2 ** -23 * F.linear(
        x.double().abs(), dense.abs()) + 1e-6
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert bool(((got.double() - exact).abs() <= bound).all())
    xb = x.bfloat16()
    got = native.qlinear(xb, w, b, quantize_x=True, lib=lib)
    exact = F.linear(xb.double(), dense, b.double())
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - exact).abs() <= bound + exact.abs() * 2 ** -8).all())


@needs_kernel
@pytest.mark.parametrize("bits,group,shared", [(4, 32, False), (6, 16, True), (6, 32, False)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 36])
def test_k_quant_int8_takes_x_per_super_block_and_its_scales_as_integers(lib, bits, group,
                                                                        shared, rows):
    """A K-quant's int8 path (qlinear.c's sblock): x rounded to int8 per
    super-block of 256 inputs (its scale the block's largest |x| / 127), each
    group's integer sum times its int8 scale and the offsets' int8s times
    the groups' sums of x's bytes, exactly in integers, then per super-block
    two fp32 multiply-adds by the float16 d and m times x's scale. Against
    that arithmetic in float64: equal to the last bits of those few fp32
    operations, where rounding x per 32 inputs (other formats') would be off
    by orders more."""
    g = torch.Generator().manual_seed(rows + bits)
    n, k, per = 40, 768, 256 // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    groups = torch.arange(k) // group
    d, e = ((torch.randn(n, k // 256, generator=g) * 0.01).half().float() for _ in range(2))
    sc = torch.randint(-128, 128, (n, k // group), generator=g).float()
    om = sc if shared else torch.randint(0, 64, (n, k // group), generator=g).float()
    w = IntGroups.from_codes(codes, groups, sc * d.repeat_interleave(per, 1), bits,
                             offset=om * e.repeat_interleave(per, 1),
                             supers=(d.repeat_interleave(per, 1), e.repeat_interleave(per, 1),
                                     per))
    assert w.supers is not None
    x = torch.randn(rows, k, generator=g) * torch.rand(1, k, generator=g) * 4
    amax = x.view(rows, -1, 256).abs().amax(-1)                 # [rows, supers], as fp32
    xs, inv = amax / 127, 127 / amax
    x8 = torch.round(x.view(rows, -1, 256) * inv[..., None]).view(rows, k).double()
    prod = (x8[:, None, :] * codes.double()[None]).view(rows, n, -1, group).sum(-1)  # per group
    isc = (prod * sc.double()[None]).view(rows, n, -1, per).sum(-1)                 # per super
    xg = x8.view(rows, -1, group).sum(-1)                                           # [rows, groups]
    ioff = (xg[:, None, :] * om.double()[None]).view(rows, n, -1, per).sum(-1)
    dxs = (d[None] * xs[:, None, :]).double()          # the fp32 products
    exs = (e[None] * xs[:, None, :]).double()
    want = (isc * dxs + ioff * exs).sum(-1)
    scale = ((isc * dxs).abs() + (ioff * exs).abs()).sum(-1)
    got = native.qlinear(x, w, quantize_x=2, lib=lib).double()
    assert bool(((got - want).abs() <= scale * 2 ** -21 + 1e-30).all())


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("n,k,group,act_order", [(40, 64, 32, False), (192, 576, 32, False),
                                                 (100, 96, -1, True), (33, 80, 20, True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int8_activations_stay_within_their_rounding(lib, bits, n, k, group, act_order, rows):
    """quantize_x 2: x rounded to int8 per block of 32 positions (its scale the
    block's largest |x| / 127) and the codes multiplied as bytes (vpdpbusd, or
    vpmaddubsw: 4-bit codes summed in int16, 8-bit ones as q - 128 with x's
    sum added back), every row-block size (1-4 and a remainder). The offsets
    multiply the same rounded x, so each output is off by sum_k w[k] e[k], e
    the rounding of x: at most half a step times sum |w| over the block, plus
    fp32 sums. A row whose block is all zeros stays exact there."""
    w, _, _ = random_weights(n, k, bits, group, act_order, zeros=not act_order, seed=rows)
    g = torch.Generator().manual_seed(rows + 13)
    x, b = torch.randn(rows, k, generator=g) * 3, torch.randn(n, generator=g)
    x[0, :32] = 0
    dense = w.dequantize().double()
    step = x.abs().max(dim=1, keepdim=True).values.double() / 127      # at most a block's
    for xin in (x, x.bfloat16()):
        got = native.qlinear(xin, w, b, quantize_x=2, lib=lib)
        exact = F.linear(xin.double(), dense, b.double())
        bound = 0.5 * step * dense.abs().sum(1) + 4 * k * 2 ** -23 * F.linear(
            xin.double().abs(), dense.abs()) + 1e-6
        if xin.dtype == torch.bfloat16:
            bound = bound + exact.abs() * 2 ** -8
        assert got.dtype == xin.dtype and got.shape == (rows, n)
        assert bool(((got.double() - exact).abs() <= bound).all())
    # and the rounding is real: the int8 answer is not the fp32 one
    assert not torch.equal(native.qlinear(x, w, quantize_x=2, lib=lib),
                           native.qlinear(x, w, quantize_x=0, lib=lib))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_the_engine_mode_takes_int8_at_every_row_count(lib, bits):
    """quantize_x 3 (what the engine passes): int8 at up to
    folio_qlinear_int8_rows(bits) rows, which is every row count on every
    build and code width (it wins there: docs/benchmarks.md), so that a row's
    arithmetic never changes path with the size of its batch; bit for bit
    the int8 path's."""
    assert lib.folio_qlinear_int8_rows(bits) == 0x7fffffff
    w, _, _ = random_weights(48, 96, bits, 32, False)
    g = torch.Generator().manual_seed(bits)
    for rows in (1, 33, 65, 513):
        x = torch.randn(rows, 96, generator=g)
        for xin in (x, x.bfloat16()):
            got = native.qlinear(xin, w, quantize_x=native.QLINEAR_INT8_AT_FEW_ROWS, lib=lib)
            assert torch.equal(got, native.qlinear(xin, w, quantize_x=2, lib=lib))


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("form", ["zeros", "offsets", "act-order", "two-level", "two-level-shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_of_a_packed_table_are_its_dequantized_rows(lib, bits, form, dtype):
    """An embedding lookup in a table kept in its codes (elementwise.c's
    folio_dequantize_rows, what a GGUF model's every step looks its tokens up
    with) gives IntGroups.dequantize_rows's rows to the bit, whatever the
    code width, scale form or order of its groups; ids out of range are an
    IndexError, nothing written."""
    if form.startswith("two-level"):       # Q6_K's groups of 16, Q4_K's and Q8's of 32
        w, _ = _two_level_weights(40, 512, bits, 16 if bits == 6 else 32, form.endswith("shared"))
        assert w.supers is not None
    else:
        w, _, _ = random_weights(40, 208, bits, 32, form == "act-order", zeros=form == "zeros")
        assert (w.perm is not None) == (form == "act-order") and w.supers is None
    ids = torch.tensor([[0, 39, 17], [16, 15, 31]])
    got = native.dequantize_rows(w, ids, dtype, lib=lib)
    assert got.dtype == dtype and got.shape == (2, 3, w.in_features)
    assert torch.equal(got, w.dequantize_rows(ids, dtype))
    # enough rows for the threads to share them
    many = torch.randint(0, 40, (700,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(native.dequantize_rows(w, many, dtype, lib=lib),
                       w.dequantize_rows(many, dtype))
    for bad in (torch.tensor([40]), torch.tensor([3, -1])):
        with pytest.raises(IndexError, match="out of range"):
            native.dequantize_rows(w, bad, dtype, lib=lib)
