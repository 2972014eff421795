"""The fused element-wise kernels (kernels/triton_elementwise.py) against the
torch layers they replace, in triton's interpreter on the CPU
(TRITON_INTERPRET=1, set by tests/conftest.py) or on CUDA where there is
one; and a model on the TRITON backend running through them gives the torch
backend's greedy tokens."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra pins it)")

from folio.kernels import triton_elementwise as te
from folio.model.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# the interpreter casts fp32 to bf16 by truncation, CUDA rounds: one step of bf16
ULP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def close(got, ref, dtype, scale=1.0):
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= 2 * ULP[dtype] * max(scale, ref.float().abs().max().item()), err


def torch_rmsnorm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_add_rmsnorm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, res = (torch.randn(5, hidden, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    out, new_res = te.add_rmsnorm(x, res, w, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(new_res, x + res)
    close(new_res, x + res, dtype)
    close(out, torch_rmsnorm(x + res, w, 1e-5), dtype)
    alone, same = te.add_rmsnorm(x, None, w, 1e-5)         # the first layer: no residual yet
    assert same is x
    close(alone, torch_rmsnorm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 1536])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_act(dtype, n, gelu):
    g = torch.Generator().manual_seed(n)
    gate_up = (3 * torch.randn(4, 2 * n, generator=g)).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    close(te.gated_act(gate_up, gelu=gelu), act * up, dtype, scale=10.0)


def reference_rotary_store(qkv, cos, sin, h, hkv, d, cache, slots):
    from folio.model.layers.rotary import apply_rotary
    t = qkv.shape[0]
    qkv = qkv.cpu().clone()       # the native bf16 rotation is in place
    qk = apply_rotary(qkv[:, :(h + hkv) * d].view(t, h + hkv, d).cpu(), cos.cpu(), sin.cpu())
    q, k = qk.split([h, hkv], dim=1)
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d).cpu()
    cache = cache.cpu().clone()
    flat = cache.view(2, -1, hkv, d)
    ok = slots.cpu() >= 0
    flat[0, slots.cpu()[ok]] = k[ok]
    flat[1, slots.cpu()[ok]] = v[ok]
    return q, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, hkv, d", [(4, 2, 64), (8, 1, 128), (3, 3, 40)])
def test_rotary_store(dtype, h, hkv, d):
    """q rotated in place, the rotated keys and the values at their slots (a
    padding token's -1 writes nothing), as apply_rotary + store_kv give them."""
    g = torch.Generator().manual_seed(d)
    t, blocks, bs = 6, 4, 8
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    rope = RotaryEmbedding(d, 256, 10000.0).to(DEVICE)
    cos, sin = rope(torch.tensor([0, 3, 17, 100, 5, 200], device=DEVICE))
    slots = torch.tensor([3, 9, -1, 30, 0, 17], device=DEVICE)
    cache = torch.zeros(2, blocks, bs, hkv, d, dtype=dtype, device=DEVICE)
    q_ref, cache_ref = reference_rotary_store(qkv, cos, sin, h, hkv, d, cache, slots)
    te.rotary_store(qkv, cos, sin, h, hkv, d, cache[0], cache[1], slots)
    close(qkv[:, :h * d].view(t, h, d).cpu(), q_ref, dtype)
    close(cache.cpu(), cache_ref, dtype)
    assert cache.view(2, -1, hkv, d).abs().sum(dim=(2, 3)).count_nonzero() == 10   # 5 slots


def test_rotary_in_place_without_a_cache():
    g = torch.Generator().manual_seed(1)
    h, hkv, d = 4, 2, 32
    qkv = torch.randn(3, (h + 2 * hkv) * d, generator=g).to(DEVICE)
    cos, sin = RotaryEmbedding(d, 64, 10000.0).to(DEVICE)(torch.tensor([1, 2, 60],
                                                                        device=DEVICE))
    from folio.model.layers.rotary import apply_rotary
    want_qk = apply_rotary(qkv[:, :(h + hkv) * d].view(3, h + hkv, d).clone().cpu(),
                           cos.cpu(), sin.cpu())
    v_before = qkv[:, (h + hkv) * d:].clone()
    te.rotary_store(qkv, cos, sin, h, hkv, d)
    close(qkv[:, :(h + hkv) * d].view(3, h + hkv, d).cpu(), want_qk, torch.float32)
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)


def test_a_model_runs_through_them_with_the_torch_backends_tokens(tmp_path, monkeypatch):
    """A tiny Llama on the TRITON backend with the fused kernels on (on the
    CPU: a test switch, the interpreter runs them): each kernel is called,
    and the greedy tokens are the torch backend's without them."""
    from folio import LLM, SamplingParams
    from tests.utils import make_tiny_model
    folder = make_tiny_model(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 30, 2], list(range(40, 61)), [7])]

    def run(name):
        llm = LLM(folder, dtype="float32", device=str(DEVICE), num_kv_blocks=32, block_size=4,
                  max_num_seqs=4, attention_backend=name)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run("TORCH_SDPA")
    calls = {"add_rmsnorm": 0, "gated_act": 0, "rotary_store": 0}
    for name in calls:
        real = getattr(te, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(te, name, counted)
    monkeypatch.setattr(te, "ON_CPU_FOR_TESTS", True)
    assert run("TRITON") == want
    assert all(n > 0 for n in calls.values()), calls


_NO_KERNEL = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select",
              "as_strided", "alias", "empty", "empty_like", "t", "transpose", "unsqueeze",
              "expand", "detach", "empty_strided", "lift_fresh"}
_PRODUCTS = {"mm", "addmm", "bmm", "linear", "matmul"}


def test_a_decode_step_runs_five_kernels_a_layer_besides_the_products(tmp_path, monkeypatch):
    """What a decoder layer launches in a decode step on the TRITON backend
    with the fused kernels (counted on the CPU, where the interpreter runs
    them, by the Triton launches and the torch ops that would be kernels):
    add + RMSNorm, rotary + KV write, attention, add + RMSNorm, SiLU x up,
    and nothing else but the four matrix products."""
    import triton
    from torch.utils._python_dispatch import TorchDispatchMode

    from folio import LLM, SamplingParams
    from folio.model import llama
    from tests.utils import make_tiny_model
    monkeypatch.setattr(te, "ON_CPU_FOR_TESTS", True)
    llm = LLM(make_tiny_model(tmp_path), dtype="float32", device=str(DEVICE), num_kv_blocks=32,
              block_size=4, max_num_seqs=4, attention_backend="TRITON", enforce_eager=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(([5, 9, 30, 2], list(range(40, 61)))):
        engine.add_tokenized_request(f"r{i}", None, prompt, params)
    engine.step()                         # both prompts: the next steps decode

    state = {"layer": False, "triton": 0}
    launches, products, others = [], [], []
    runs = [cls for cls in (getattr(triton.runtime.interpreter, "InterpretedFunction", None),
                            triton.runtime.jit.JITFunction) if cls is not None]
    for cls in runs:
        real_run = cls.run

        def run(self, *a, _real=real_run, **kw):
            if state["layer"] and not state["triton"]:
                launches.append(getattr(self, "__name__", None) or self.fn.__name__)
            state["triton"] += 1
            try:
                return _real(self, *a, **kw)
            finally:
                state["triton"] -= 1
        monkeypatch.setattr(cls, "run", run)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if state["layer"] and not state["triton"] and name not in _NO_KERNEL:
                (products if name in _PRODUCTS else others).append(name)
            return func(*args, **(kwargs or {}))

    real_forward = llama.LlamaDecoderLayer.forward

    def forward(self, *a, **kw):
        state["layer"] = True
        try:
            return real_forward(self, *a, **kw)
        finally:
            state["layer"] = False
    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", forward)
    with Ops():
        engine.step()                     # a decode step of two sequences
    seen = list(launches), list(products), list(others)
    while engine.has_unfinished_requests():
        engine.step()
    kernels, matmuls, rest = seen
    layers = llm.engine.executor.runner.model.config.num_hidden_layers
    assert len(kernels) == 5 * layers, kernels
    assert kernels[:5] == ["_add_rmsnorm_kernel", "_rotary_store_kernel", "_decode_kernel",
                           "_add_rmsnorm_kernel", "_gated_act_kernel"], kernels[:5]
    assert len(matmuls) == 4 * layers and rest == [], (matmuls, rest)
