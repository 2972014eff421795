"""The fused MoE layer against the per-token reference: random inputs over
expert counts and top-k, every token on one expert, experts nobody picks; each
chosen expert run once per step; the routers against transformers' own; the
tensor-parallel slices summing to the whole layer."""

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from folio.kernels import native
from folio.model.layers import moe
from folio.model.layers.moe import (FusedMoE, dense_experts, fused_experts, reference_experts,
                                    route)

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)


def _weights(e: int, h: int, i: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * i, h, generator=g) * 0.3, torch.randn(e, h, i, generator=g) * 0.3,
            torch.randn(64, h, generator=g))


@pytest.mark.parametrize("experts,top_k,tokens", [(1, 1, 5), (4, 2, 1), (4, 2, 17), (8, 2, 33),
                                                  (8, 3, 9), (16, 4, 50), (5, 5, 7)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_matches_the_per_token_loop(experts, top_k, tokens, renormalize):
    w13, w2, xs = _weights(experts, 24, 12, experts * 100 + top_k)
    x = xs[:tokens]
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    weights, ids = route(logits, top_k, renormalize, weights_in_float=True)
    want = reference_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), want,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense_experts(x, w13, w2, weights, ids), want,
                               atol=1e-5, rtol=1e-5)


def test_every_token_on_the_same_experts_and_experts_nobody_picks(monkeypatch):
    """8 experts, all 20 tokens routed to experts 6 and 2: those two run once
    each, on all 20 rows; the other six never run."""
    w13, w2, xs = _weights(8, 16, 8, 1)
    x = xs[:20]
    ids = torch.tensor([[6, 2]] * 20)
    weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(2))
    calls, real = [], moe._expert

    def counted(rows, a, b):
        calls.append((rows.shape[0], (a.data_ptr() - w13.data_ptr()) // a.nbytes))
        return real(rows, a, b)

    monkeypatch.setattr(moe, "_expert", counted)
    got = fused_experts(x, w13, w2, weights, ids)
    assert calls == [(20, 2), (20, 6)]
    torch.testing.assert_close(got, reference_experts(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)
    # the unchosen experts' weights do not matter: garbage there changes nothing
    w13[[0, 1, 3, 4, 5, 7]] = float("nan")
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), got)


def test_each_chosen_expert_runs_once_per_step(monkeypatch):
    w13, w2, xs = _weights(8, 16, 8, 3)
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(4))
    weights, ids = route(logits, 2, True, weights_in_float=True)
    rows = []
    real = moe._expert
    monkeypatch.setattr(moe, "_expert", lambda r, a, b: rows.append(r.shape[0]) or real(r, a, b))
    fused_experts(xs[:40], w13, w2, weights, ids)
    assert len(rows) == len(ids.unique()) and sum(rows) == 80


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,weights_in_float", [(2, True), (2, False), (8, False)])
@pytest.mark.parametrize("packing", ["none", "packed", "int4"])
def test_one_token_runs_its_experts_in_turn_as_the_grouped_path_sums(monkeypatch, dtype, top_k,
                                                                     weights_in_float, packing):
    """A decode step of one request: its k experts run in turn, one row each,
    with no sort or scatter, and the output is the grouped path's bit for bit
    (the same terms, rounded alike, added in the same order: k = 8 is
    Qwen3-MoE's, where the order of a bf16 sum shows)."""
    from folio.model.layers.quantization import get_quantization_config
    w13, w2, xs = _weights(16, 64, 32, top_k)
    layer = FusedMoE(64, 32, 16, top_k, True, dtype, "blk", ("w1", "w3", "w2"),
                     quant_config=get_quantization_config("int4", {}) if packing == "int4"
                     else None)
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    w13, w2, x = w13.to(dtype), w2.to(dtype), xs[3:4].to(dtype)
    if packing != "none":
        layer.process_weights_after_loading()
        if layer.packed_experts is None:
            pytest.skip(f"no packed {dtype} product on this machine")
    packed = layer.packed_experts
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(9)).to(dtype)
    weights, ids = route(logits, top_k, True, weights_in_float)
    want = moe.grouped_experts(x, w13, w2, weights, ids, packed)
    rows = []
    real = moe._expert
    monkeypatch.setattr(moe, "_expert", lambda r, *a: rows.append(r.shape[0]) or real(r, *a))
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: pytest.fail("sorted one token"))
    got = fused_experts(x, w13, w2, weights, ids, packed)
    assert rows == [1] * top_k
    assert got.dtype == dtype and torch.equal(got, want)
    if packing != "int4":          # (the codes' own loop: the quantized-experts test)
        torch.testing.assert_close(
            got.float(), reference_experts(x, w13, w2, weights, ids).float(),
            **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2,
                                                                               rtol=3e-2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routers_match_transformers(dtype):
    """Mixtral: softmax, top-k, renormalize, fp32 weights; Qwen3-MoE: the same
    with renormalization only under norm_topk_prob, weights in the dtype."""
    x = torch.randn(30, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    for norm in (True, False):
        cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2,
                                          norm_topk_prob=norm)
        ref = Qwen3MoeTopKRouter(cfg).to(dtype)
        torch.nn.init.normal_(ref.weight)
        _, want_w, want_i = ref(x)
        got_w, got_i = route(torch.nn.functional.linear(x, ref.weight), 2, norm, False)
        assert torch.equal(got_i, want_i) and got_w.dtype == want_w.dtype == dtype
        torch.testing.assert_close(got_w, want_w)
    cfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    ref = MixtralTopKRouter(cfg).to(dtype)
    torch.nn.init.normal_(ref.weight)
    _, want_w, want_i = ref(x)
    got_w, got_i = route(torch.nn.functional.linear(x, ref.weight), 2, True, True)
    assert torch.equal(got_i, want_i) and got_w.dtype == want_w.dtype == torch.float32
    torch.testing.assert_close(got_w, want_w)


def _layer(tp: int, rank: int, monkeypatch, experts=4, hidden=16, inter=8):
    monkeypatch.setattr(moe, "tp_size", lambda: tp)
    monkeypatch.setattr(moe, "tp_rank", lambda: rank)
    return FusedMoE(hidden, inter, experts, 2, True, torch.float32, "blk", ("w1", "w3", "w2"),
                    weights_in_float=True)


def _load(layer, ckpt):
    for p in layer.parameters():
        for shard, name in p.checkpoint_names.items():
            loader = getattr(p, "weight_loader", None)
            if loader is None:
                p.data.copy_(ckpt[name])
            else:
                loader(p, ckpt[name], shard)


def test_the_tensor_parallel_slices_sum_to_the_whole_layer(monkeypatch):
    g = torch.Generator().manual_seed(6)
    ckpt = {"blk.gate.weight": torch.randn(4, 16, generator=g)}
    for e in range(4):
        for n, shape in (("w1", (8, 16)), ("w3", (8, 16)), ("w2", (16, 8))):
            ckpt[f"blk.experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g) * 0.3
    x = torch.randn(11, 16, generator=g)
    whole = _layer(1, 0, monkeypatch)
    _load(whole, ckpt)
    assert torch.equal(whole.w13_weight[2, :8], ckpt["blk.experts.2.w1.weight"])
    assert torch.equal(whole.w13_weight[2, 8:], ckpt["blk.experts.2.w3.weight"])
    assert torch.equal(whole.w2_weight[3], ckpt["blk.experts.3.w2.weight"])
    monkeypatch.setattr(moe, "all_reduce", lambda y, size: y)      # the sum is taken below
    parts = []
    for rank in (0, 1):
        layer = _layer(2, rank, monkeypatch)
        _load(layer, ckpt)
        assert layer.w13_weight.shape == (4, 8, 16) and layer.w2_weight.shape == (4, 16, 4)
        parts.append(layer(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-5, rtol=1e-5)


def test_a_tensor_that_does_not_fit_is_named(monkeypatch):
    layer = _layer(1, 0, monkeypatch)
    with pytest.raises(ValueError, match=r"shape \(8, 15\) does not fit"):
        layer.w13_weight.weight_loader(layer.w13_weight, torch.zeros(8, 15), (0, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_give_the_per_token_loop(dtype):
    """On the CPU the loaded layer packs each expert's matrices as the dense
    layers' are (bf16: oneDNN's layout or the native kernel's) and keeps only
    those; its output is the per-token loop's on the same weights."""
    from folio.model.layers.linear import pack_weight
    w13, w2, xs = _weights(8, 64, 32, 5)
    w13, w2, x = w13.to(dtype), w2.to(dtype), xs[:19].to(dtype)
    layer = FusedMoE(64, 32, 8, 2, True, dtype, "blk", ("w1", "w3", "w2"))
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
        layer.gate.weight.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)))
    weights, ids = route(layer.gate(x), 2, True, False)
    want = reference_experts(x, w13, w2, weights, ids)
    layer.process_weights_after_loading()
    if pack_weight(w13[0]) is None:
        pytest.skip(f"no packed {dtype} product on this machine")
    assert len(layer.packed_experts) == 8 and layer.w13_weight.numel() == 0
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2,
                                                                               rtol=3e-2)
    torch.testing.assert_close(layer(x), want, **tolerance)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_are_the_loop_on_their_dequantized_weights(method):
    """`--quantization int8|int4`: each expert matrix in RTN's codes, run on
    IntGroups' kernel in fp32 arithmetic: the per-token loop on the dequantized
    codes, to fp32 rounding; and each weight within half a step of the float's."""
    from folio.model.layers.quantization import get_quantization_config
    from folio.model.layers.quantization.int_groups import set_activation_quantization
    w13, w2, xs = _weights(8, 64, 32, 7)
    x = xs[:13]
    layer = FusedMoE(64, 32, 8, 2, True, torch.float32, "blk", ("w1", "w3", "w2"),
                     quant_config=get_quantization_config(method, {}))
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
        layer.gate.weight.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(3)))
    layer.process_weights_after_loading()
    set_activation_quantization(layer, "none")
    held13 = torch.stack([a.weights.dequantize() for a, _ in layer.packed_experts])
    held2 = torch.stack([b.weights.dequantize() for _, b in layer.packed_experts])
    assert held13.shape == w13.shape and held2.shape == w2.shape
    step = (w13.abs().amax() / 127) if method == "int8" else (w13.amax() - w13.amin()) / 15
    assert (held13 - w13).abs().max() <= step / 2 + 1e-6
    weights, ids = route(layer.gate(x), 2, True, False)
    torch.testing.assert_close(layer(x), reference_experts(x, held13, held2, weights, ids),
                               atol=1e-4, rtol=1e-4)
    # the capture-safe form (every expert on every token) gives the same
    torch.testing.assert_close(
        moe.dense_packed_experts(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                 layer.packed_experts), layer(x), atol=1e-5, rtol=1e-5)


def test_a_bf16_router_on_the_cpu_multiplies_in_fp32_and_rounds_once():
    """The router's logits are a bf16 product's (exact products, fp32 sums, one
    rounding to bf16), made on an fp32 copy of W: at one token oneDNN's bf16
    path costs 8x the fp32 product on an AMX CPU."""
    from folio.model.layers.moe import Router
    g = torch.Generator().manual_seed(0)
    router = Router(768, 16, torch.bfloat16)
    router.weight.data = torch.randn(16, 768, generator=g).bfloat16()
    router.prepare()
    assert router.w32 is not None and router.w32.dtype == torch.float32
    x = torch.randn(5, 768, generator=g).bfloat16()
    got = router(x)
    exact = (x.double() @ router.weight.double().t()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact)
    fp32 = Router(768, 16, torch.float32)
    fp32.prepare()
    assert fp32.w32 is None                      # an fp32 router is its own product


needs_native = pytest.mark.skipif(not native.supports(torch.zeros(1)),
                                  reason="no native CPU kernels here (no C compiler)")


@needs_native
@pytest.mark.parametrize("experts,top_k,tokens", [(8, 2, 1), (8, 2, 33), (16, 4, 9),
                                                  (128, 8, 5), (5, 5, 3)])
@pytest.mark.parametrize("renormalize,weights_in_float", [(True, True), (True, False),
                                                          (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_router_routes_as_the_torch_one(experts, top_k, tokens, renormalize,
                                                   weights_in_float, dtype):
    """native/moe.c (what a bf16 run on the CPU and the one-call decoder route
    with) against the Router's logits through `route`: experts of the same
    logits (bf16 logits tie often, and torch.topk orders ties as it likes;
    moe.c takes the lower id; the experts' sum runs in expert order either
    way), the weights in the same dtype to the last rounding (its fp32 sums run
    in another order)."""
    g = torch.Generator().manual_seed(experts * 10 + tokens)
    w32 = torch.randn(experts, 96, generator=g)
    x = torch.randn(tokens, 96, generator=g).to(dtype)
    logits = torch.nn.functional.linear(x.float(), w32).to(dtype)
    want_w, want_i = route(logits, top_k, renormalize, weights_in_float)
    got_w, got_i = native.moe_route(x, w32, top_k, renormalize, weights_in_float)
    assert torch.equal(logits.gather(1, got_i), logits.gather(1, want_i))
    if dtype == torch.float32:          # no ties: the same experts, in the same order
        assert torch.equal(got_i, want_i)
    assert got_w.dtype == want_w.dtype == (torch.float32 if weights_in_float else dtype)
    torch.testing.assert_close(got_w, want_w, **(dict(atol=1e-6, rtol=1e-5)
                                                 if got_w.dtype == torch.float32 else {}))


@needs_native
def test_the_native_router_refuses_what_it_cannot_route():
    x, w32 = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="top_k of at most their number, got 4 and 5"):
        native.moe_route(x, w32, 5, True, True)
    with pytest.raises(ValueError, match="contiguous fp32 router"):
        native.moe_route(x, w32.bfloat16(), 2, True, True)
    # NaN logits choose no expert: k valid ids (never out of range), weight 0
    w, ids = native.moe_route(torch.full((1, 8), float("nan")), w32, 2, False, True)
    assert ids.tolist() == [[0, 1]] and w.tolist() == [[0.0, 0.0]]
