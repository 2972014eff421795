"""The 8-bit KV caches (issue 32, attention/kv_quant.py): each row of one
token and head stored as int8 steps of its own scale (max |row| / 127), or
as e4m3 values of max |row| / 448 (fp8), the scale beside it; the native
kernel reads every fp8 byte as torch does. Rounding is held to half a step per value (a scale off by
1% breaks that bound); the torch backend's attention over an int8 cache is
its attention over a float cache holding the dequantized rows, decodes and
prompt chunks across blocks, GQA, several block sizes; and the block
arithmetic counts the scales."""

import pytest
import torch

from folio.model.attention import kv_quant
from folio.model.attention.backend import StepDescription
from folio.model.attention.torch_backend import TorchAttentionBackend
from tests.model import native_builds

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)


def _rows(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))   # rows of any size


def test_each_value_is_within_half_a_step_of_its_row_s_scale():
    x = _rows(0, 50, 4, 64)
    x[3, 1] = 0                                       # an all-zero row stays zero
    q = kv_quant.quantize(x)
    assert q.dtype == torch.int8 and q.shape == (50, 4, 68)
    scale = kv_quant.scales(q)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    back = kv_quant.dequantize(q, torch.float32)
    assert (back - x).abs().le(scale / 2 * (1 + 1e-5) + 1e-12).all()
    assert back[3, 1].eq(0).all()
    assert q[..., :64].abs().max() == 127           # each row's largest value is a full step
    # a scale 1% off moves the largest values by more than half a step
    wrong = q.clone()
    wrong[..., 64:] = (scale * 1.01).view(torch.int8)
    assert not (kv_quant.dequantize(wrong, torch.float32) - x).abs().le(scale / 2).all()
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_quant.row_width(66, "int8")


def _attend(cache_dtype, width, q, k, v, spans, block_size, num_blocks, backend):
    """The backend's outputs for the step `spans` over a fresh cache."""
    hkv, d = k.shape[1], k.shape[2]
    cache = torch.zeros(2, num_blocks, block_size, hkv, width, dtype=cache_dtype)
    out = []
    for step_spans, rows in spans:
        step, _ = StepDescription.of_spans(step_spans, block_size, torch.device("cpu"))
        meta = TorchAttentionBackend.build_metadata(step)
        out.append(backend.forward(q[rows], k[rows], v[rows], cache, meta))
    return torch.cat(out)


@pytest.mark.parametrize("block_size, heads, kv_heads", [(4, 4, 2), (16, 6, 6), (8, 8, 1)])
def test_attention_over_an_int8_cache_is_attention_over_its_dequantized_rows(
        block_size, heads, kv_heads):
    import numpy as np
    d = 32
    backend = TorchAttentionBackend(heads, kv_heads, d, d ** -0.5)
    g = torch.Generator().manual_seed(block_size)
    # two sequences: a whole prompt, then a later chunk, then a decode each
    lens = [(0, 13), (13, 7)], [(0, 9), (9, 11)]
    total = sum(n for seq in lens for _, n in seq) + 2
    q = torch.randn(total, heads, d, generator=g)
    k, v = _rows(1, total, kv_heads, d), _rows(2, total, kv_heads, d)
    tables = [np.arange(0, 8, dtype=np.int64), np.arange(8, 16, dtype=np.int64)]
    steps, row = [], 0
    for chunk in range(2):
        spans = [(start, n, tables[i]) for i, seq in enumerate(lens)
                 for start, n in [seq[chunk]]]
        n = sum(s[1] for s in spans)
        steps.append((spans, slice(row, row + n)))
        row += n
    steps.append(([(20, 1, tables[0]), (20, 1, tables[1])], slice(row, row + 2)))
    got = _attend(torch.int8, d + 4, q, k, v, steps, block_size, 16, backend)
    deq = lambda x: kv_quant.dequantize(kv_quant.quantize(x), torch.float32)      # noqa: E731
    want = _attend(torch.float32, d, q, deq(k), deq(v), steps, block_size, 16, backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = _attend(torch.float32, d, q, k, v, steps, block_size, 16, backend)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()      # and close to float


def test_a_block_holds_its_rows_and_their_scales(tmp_path):
    from folio import LLM
    from tests.utils import make_tiny_model
    folder = make_tiny_model(tmp_path)
    sizes = {}
    for kv in ("float32", "bfloat16", "int8"):
        llm = LLM(folder, dtype="float32", kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20,
                  block_size=16)
        cache = llm.engine.executor.runner.kv_caches[0]
        sizes[kv] = (llm.engine.num_blocks, cache.dtype, cache.shape[-1])
    # 2 layers x 2 (k, v) x 16 tokens x 2 KV heads x 16 dims: fp32 4 bytes, bf16 2,
    # int8 1 byte a value and 4 a row's scale
    assert sizes["float32"] == ((1 << 20) // (2 * 2 * 16 * 2 * 16 * 4), torch.float32, 16)
    assert sizes["bfloat16"] == ((1 << 20) // (2 * 2 * 16 * 2 * 16 * 2), torch.bfloat16, 16)
    assert sizes["int8"] == ((1 << 20) // (2 * 2 * 16 * 2 * 20), torch.int8, 20)


def test_fp8_rows_are_e4m3_steps_of_their_scale():
    x = _rows(3, 40, 2, 64)
    q = kv_quant.quantize(x, "fp8")
    assert q.dtype == torch.uint8 and q.shape == (40, 2, 68)
    scale = kv_quant.scales(q)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 448)
    back = kv_quant.dequantize(q, torch.float32)
    # e4m3: 3 mantissa bits, half a step is 1/16 of the value (subnormals: 2^-10)
    assert ((back - x).abs() <= (x.abs() / 16 + 2 ** -10 * scale) * (1 + 1e-6)).all()
    assert (back.abs().amax(-1, keepdim=True) - x.abs().amax(-1, keepdim=True)).abs().max() \
        < 1e-5 * x.abs().max()                       # each row's largest is exact


def _every_byte_decoded(flags, storage, fp8, finite):
    """Rows holding every byte `finite` keeps (subnormals, zeros, both signs),
    each the only key of a decode, the cache viewed as `storage`: the kernel's
    output against the rows dequantized by torch as `fp8` (scale 0.75)."""
    from folio.kernels import native
    lib = native_builds.library(flags)
    values = [b for b in range(256) if finite(b)]
    values += [0] * (256 - len(values))
    steps = torch.tensor(values, dtype=torch.uint8).view(4, 64)
    rows = torch.cat([steps, torch.tensor([0.75], dtype=torch.float32).view(torch.uint8)
                      .repeat(4, 1)], dim=1)                        # scale 0.75
    cache = torch.zeros(2, 4, 1, 1, 68, dtype=torch.uint8)
    cache[1, :, 0, 0] = rows                                        # the values
    q = torch.zeros(4, 1, 64)
    out = native.paged_attention(q, cache.view(storage), torch.arange(4).view(4, 1),
                                 torch.arange(4), torch.ones(4, dtype=torch.int64), 0.125, lib)
    return out[:, 0], steps.view(fp8).float() * 0.75


@pytest.mark.parametrize("flags", native_builds.builds())
def test_the_kernel_reads_every_fp8_byte_as_torch_does(flags):
    """Every e4m3 byte but NaN, stored as uint8: dequantized in registers
    exactly as torch's float8_e4m3fn gives it."""
    got, want = _every_byte_decoded(flags, torch.uint8, torch.float8_e4m3fn,
                                    lambda b: b not in (0x7f, 0xff))
    assert torch.equal(got, want)


def test_fp8_e5m2_rows_are_e5m2_steps_of_their_scale():
    x = _rows(4, 40, 2, 64)
    q = kv_quant.quantize(x, "fp8_e5m2")
    assert q.dtype == torch.float8_e5m2 and q.shape == (40, 2, 68)
    scale = kv_quant.scales(q)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 57344)
    back = kv_quant.dequantize(q, torch.float32)
    # e5m2: 2 mantissa bits, half a step is 1/8 of the value (subnormals: 2^-17)
    assert ((back - x).abs() <= (x.abs() / 8 + 2 ** -17 * scale) * (1 + 1e-6)).all()
    assert kv_quant.stored(x, torch.float8_e5m2).dtype == torch.float8_e5m2


@pytest.mark.parametrize("flags", native_builds.builds())
def test_the_kernel_reads_every_e5m2_byte_as_torch_does(flags):
    """Every finite e5m2 byte (not inf or nan), stored as float8_e5m2: the
    output is the row, dequantized as torch dequantizes it, whichever build
    (AVX-512, AVX2, portable) runs."""
    got, want = _every_byte_decoded(flags, torch.float8_e5m2, torch.float8_e5m2,
                                    lambda b: (b & 0x7c) != 0x7c)
    assert torch.equal(got, want)
