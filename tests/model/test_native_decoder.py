"""All decoder layers in one native call against the torch modules calling the
same kernels one by one: bit-identical hidden states and KV caches on every
step of a run that mixes decodes with chunked prefills (bf16). On the split
path (fp32 activations, bf16-stored weights: --dtype bfloat16 on a CPU without
native bf16) the modules keep torch's fp32 element-wise ops, so the two agree
to fp32 rounding."""

from pathlib import Path

import pytest
import torch

from folio import LLM, SamplingParams
from folio.kernels import native
from folio.model import llama
from folio.model.layers import linear as linear_mod
from folio.worker import device
from tests.utils import make_tiny_model, write_tiny_gguf

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

needs_bf16_kernel = pytest.mark.skipif(not native.has_bf16_linear(),
                                       reason="no AVX512-BF16 kernels on this machine")


def _native_even_with_amx(monkeypatch):
    """On an AMX CPU the engine keeps oneDNN for bf16; the AVX512-BF16 kernels
    it also has are what these tests are about."""
    monkeypatch.setattr(native, "prefers_onednn_bf16", lambda: False)


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    _native_even_with_amx(monkeypatch)


needs_avx2_kernel = pytest.mark.skipif(not native.packs_linear_bf16w(torch.zeros(8, 8)),
                                       reason="no AVX2 + FMA kernel on this machine "
                                              "(or no compiler)")


def _record_both_paths(monkeypatch):
    """Every forward runs the native call, then the modules on the same inputs
    and caches; the comparisons are recorded and the native result returned."""
    records = []
    forward = llama.LlamaModel.forward

    def both(self, input_ids, positions, kv_caches, meta, intermediate=None):
        assert intermediate is None             # the whole model, one stage
        decoder = self.native_decoder
        assert decoder is not None and decoder.usable(self.embed_tokens(input_ids), meta)
        before = [c.clone() for c in kv_caches]
        fast = forward(self, input_ids, positions, kv_caches, meta)
        fast_caches = [c.clone() for c in kv_caches]
        for cache, saved in zip(kv_caches, before):
            cache.copy_(saved)
        self.native_decoder = None
        try:
            slow = forward(self, input_ids, positions, kv_caches, meta)
        finally:
            self.native_decoder = decoder
        records.append((input_ids.shape[0], meta.num_decodes, torch.equal(fast, slow),
                        all(torch.equal(a, b) for a, b in zip(fast_caches, kv_caches)),
                        _relative(fast, slow), max(_relative(a, b)
                                                   for a, b in zip(fast_caches, kv_caches))))
        return fast

    monkeypatch.setattr(llama.LlamaModel, "forward", both)
    return records


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@needs_bf16_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # a qkv bias; per-head q/k norms
def test_one_call_equals_the_modules_bit_for_bit(tmp_path, monkeypatch, arch):
    llm = LLM(make_tiny_model(tmp_path, arch=arch), dtype="bfloat16", num_kv_blocks=64,
              max_num_batched_tokens=48)
    assert llm.engine.executor.runner.model.model.native_decoder is not None
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records), \
        "no step mixed decodes with a prefill chunk"
    assert all(r[2] and r[3] for r in records), records


@needs_bf16_kernel
def test_a_sliding_window_in_one_call_equals_the_modules(tmp_path, monkeypatch):
    """Mistral's window (16 keys, prompts and runs past it) attended by the one
    call as by the modules (whose native attention takes the window), bit for bit."""
    path = make_tiny_model(tmp_path, arch="mistral", sliding_window=16)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=48)
    model = llm.engine.executor.runner.model.model
    assert model.native_decoder is not None
    assert {layer.self_attn.attn.sliding_window for layer in model.layers} == {16}
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    assert all(r[2] and r[3] for r in records), records


@needs_avx2_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_split_one_call_agrees_with_the_modules_to_fp32_rounding(tmp_path, monkeypatch, arch):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    # the cache in fp32 (auto would keep it in bf16, where a value that fp32
    # rounding moves across a tie moves by a bf16 step: the bf16-cache test)
    llm = LLM(make_tiny_model(tmp_path, arch=arch), dtype="bfloat16", num_kv_blocks=64,
              max_num_batched_tokens=48, kv_cache_dtype="float32")
    assert (llm.engine.config.dtype, llm.engine.config.weight_dtype) == ("float32", "bfloat16")
    decoder = llm.engine.executor.runner.model.model.native_decoder
    assert decoder is not None and decoder.bf16_weights
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    # an fp32 sum in another order and exp/rsqrt to the kernels' precision
    assert all(hidden < 1e-4 and cache < 1e-4 for *_, hidden, cache in records), records


@needs_avx2_kernel
def test_split_one_call_gives_the_modules_greedy_tokens(monkeypatch):
    """The default model through the engine, both ways: the same greedy tokens."""
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    llm = LLM(dtype="bfloat16", num_kv_blocks=128, quantization="none")
    model = llm.engine.executor.runner.model.model
    assert model.native_decoder is not None and model.native_decoder.bf16_weights
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    decoder, model.native_decoder = model.native_decoder, None
    assert llm.reset_prefix_cache()
    slow = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model.native_decoder = decoder
    assert fast == slow


@needs_bf16_kernel
def test_default_model_takes_it_and_answers_as_the_modules(monkeypatch):
    llm = LLM(dtype="bfloat16", num_kv_blocks=128, quantization="none")
    records = _record_both_paths(monkeypatch)
    llm.generate(["The capital of France is", "def fibonacci(n):"],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert records and all(r[2] and r[3] for r in records), records


@needs_bf16_kernel
def test_only_where_every_kernel_serves(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path)
    llm = LLM(folder, dtype="float32", num_kv_blocks=32)
    assert llm.engine.executor.runner.model.model.native_decoder is None      # fp32: modules
    monkeypatch.setattr(linear_mod, "pack_weight", lambda w, store=None: linear_mod.pack_onednn(w))
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=32)
    assert llm.engine.executor.runner.model.model.native_decoder is None      # oneDNN weights
    monkeypatch.undo()
    _native_even_with_amx(monkeypatch)
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=32)
    model = llm.engine.executor.runner.model.model
    assert model.native_decoder is not None
    calls = []
    monkeypatch.setattr(type(model.native_decoder), "__call__",
                        lambda *a: calls.append(1) or pytest.fail("native path taken"))
    monkeypatch.setattr(native, "fuses", lambda x: False)       # kernels switched off: modules
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and not calls


@needs_bf16_kernel
def test_same_answers_under_preemption_sharing_and_sampling(tmp_path):
    """Through the engine: a pool small enough to preempt, a shared prefix,
    seeded n=2 sampling with logprobs. Bit-identical forwards must give the
    same tokens and logprobs with the one call as with the modules."""
    llm = LLM(make_tiny_model(tmp_path, max_position_embeddings=512), dtype="bfloat16",
              num_kv_blocks=24, block_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    model = llm.engine.executor.runner.model.model
    prefix = list(range(10, 42))
    prompts = [{"prompt_token_ids": prefix + [50 + i] * (5 + 7 * i)} for i in range(8)]
    params = SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=24, ignore_eos=True,
                            logprobs=2)

    def run():
        assert llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in o.outputs]
                for o in outs]

    fast = run()
    preempted = llm.engine.scheduler.num_preemptions
    decoder, model.native_decoder = model.native_decoder, None
    slow = run()
    assert preempted > 0 and fast == slow
    assert llm.engine.scheduler.kv.num_free_blocks == 24
    model.native_decoder = decoder


needs_quantized_kernel = pytest.mark.skipif(not native.runs_qlinear(torch.zeros(1)),
                                            reason="no quantized linear kernel on this machine")


@needs_quantized_kernel
@pytest.mark.parametrize("qtype,arch", [("Q4_1", "llama"), ("Q8_0", "llama"),
                                        ("Q4_1", "qwen3"), ("Q4_K_M", "llama")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_quantized_one_call_agrees_with_the_modules(tmp_path, monkeypatch, qtype, arch, dtype):
    """Quantized projections (a GGUF kept in its codes; Q4_K_M: llama.cpp's file,
    4- and 6-bit codes under two-level scales): bf16 runs call the
    same kernels in the same order both ways (bit for bit); fp32 ones (and
    bfloat16 asked on a CPU without native bf16, which runs fp32) fuse the
    element-wise layers the modules keep in torch (fp32 rounding), so they run
    fp32 arithmetic on the codes: int8 activations would round x, and a value
    that fp32 rounding moves across a rounding tie moves by a whole step."""
    if dtype == "bfloat16" and not native.fuses(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no bf16 element-wise kernels here")
    if qtype == "Q4_K_M":
        path = str(Path(__file__).parent.parent / "fixtures" / "gguf" / "tiny-llama-Q4_K_M.gguf")
    else:
        folder = make_tiny_model(tmp_path / "hf", arch=arch, intermediate_size=128)
        path = write_tiny_gguf(folder, tmp_path / "m.gguf", qtype)
    fp32 = device.split_cpu_bf16(dtype, "cpu")[0] == "float32"
    # an fp32 run keeps an fp32 cache here (the bf16-cache test is below)
    llm = LLM(path, dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=48,
              activation_quantization="none" if fp32 else "int8",
              kv_cache_dtype="float32" if fp32 else "auto")
    decoder = llm.engine.executor.runner.model.model.native_decoder
    assert decoder is not None and decoder.quantized
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    if llm.engine.config.dtype == "bfloat16":      # not on a CPU without native bf16
        assert all(r[2] and r[3] for r in records), records
    else:
        assert all(hidden < 1e-4 and cache < 1e-4 for *_, hidden, cache in records), records


@needs_quantized_kernel
def test_a_bfloat16_cache_under_float32_in_one_call(tmp_path, monkeypatch):
    """--kv-cache-dtype bfloat16 on a float32 run: the one call writes its keys
    and values rounded to bf16 (as the modules' torch cast does) and attends
    over them widened. The caches agree to a bf16 rounding where fp32 rounding
    moved a value across a tie; the hidden states to fp32 rounding."""
    folder = make_tiny_model(tmp_path / "hf", intermediate_size=128)
    llm = LLM(write_tiny_gguf(folder, tmp_path / "m.gguf", "Q4_1"), dtype="float32",
              num_kv_blocks=64, max_num_batched_tokens=48, activation_quantization="none",
              kv_cache_dtype="bfloat16")
    caches = llm.engine.executor.runner.kv_caches
    assert {c.dtype for c in caches} == {torch.bfloat16}
    assert llm.engine.executor.runner.model.model.native_decoder is not None
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    assert sum(r[3] for r in records) > len(records) / 2   # most steps' caches bit for bit
    assert all(hidden < 1e-4 and cache < 2 ** -7 for *_, hidden, cache in records), records


@needs_quantized_kernel
def test_quantized_layers_leave_the_one_call_when_their_kernel_is_off(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "hf", intermediate_size=128)
    llm = LLM(write_tiny_gguf(folder, tmp_path / "m.gguf", "Q4_0"), dtype="float32",
              num_kv_blocks=32)
    model = llm.engine.executor.runner.model.model
    assert model.native_decoder is not None
    monkeypatch.setattr(type(model.native_decoder), "__call__",
                        lambda *a: pytest.fail("native path taken"))
    monkeypatch.setattr(native, "runs_qlinear", lambda x: False)    # the torch path throughout
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_weights_off_the_cpu_never_build_the_cpu_kernels(monkeypatch):
    """On the H200 (2026-12-04) a CUDA engine spent over 90 s compiling the CPU
    kernels for a one-call decoder it never calls; weights elsewhere than the
    CPU decline it before the library is loaded."""
    from folio.model.native_decoder import NativeDecoder
    monkeypatch.setattr(native, "load", lambda: pytest.fail("built the CPU kernels"))
    assert NativeDecoder.build([torch.nn.Linear(4, 4, device="meta")]) is None


@pytest.mark.parametrize("kind", [
    pytest.param("bf16", marks=needs_bf16_kernel),
    pytest.param("Q4_1 bf16", marks=needs_quantized_kernel),
    pytest.param("Q4_1 fp32", marks=needs_quantized_kernel)])
def test_lora_adapters_run_in_the_one_call_as_in_the_modules(tmp_path, monkeypatch, kind):
    """LoRA slots on every projection, two adapters and the base mixed in
    each step: the one call runs the grouped kernel after each projection
    as the modules' layers do (bit for bit in bf16, to fp32 rounding in
    fp32), and the adapters change the answers."""
    from folio import LoRARequest
    from tests.utils import make_lora_adapter
    if kind == "Q4_1 bf16" and not native.fuses(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no bf16 element-wise kernels here")
    folder = make_tiny_model(tmp_path / "hf", intermediate_size=128)
    loras = []
    for i, modules in enumerate((["q_proj", "v_proj", "o_proj", "down_proj"],
                                 ["k_proj", "gate_proj", "up_proj"])):
        path, _ = make_lora_adapter(folder, tmp_path / f"a{i}", seed=i, r=8, lora_alpha=16,
                                    target_modules=modules)
        loras.append(LoRARequest(f"a{i}", i + 1, path))
    model, dtype = str(folder), "bfloat16"
    extra = {}
    if kind.startswith("Q4_1"):
        model = write_tiny_gguf(folder, tmp_path / "m.gguf", "Q4_1")
        dtype = kind.split()[1].replace("bf16", "bfloat16").replace("fp32", "float32")
        fp32 = device.split_cpu_bf16(dtype, "cpu")[0] == "float32"
        extra = dict(activation_quantization="none" if fp32 else "int8",
                     kv_cache_dtype="float32" if fp32 else "auto")
    llm = LLM(model, dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=48,
              enable_lora=True, max_loras=2, **extra)
    assert llm.engine.executor.runner.model.model.native_decoder is not None
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33, 12, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(prompts, params, use_tqdm=False)
    records = _record_both_paths(monkeypatch)
    got = llm.generate(prompts, params, lora_request=[loras[0], loras[1], None] * 2,
                       use_tqdm=False)
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    if llm.engine.config.dtype == "bfloat16":
        assert all(r[2] and r[3] for r in records), records
    else:
        assert all(hidden < 1e-4 and cache < 1e-4 for *_, hidden, cache in records), records
    changed = [a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(plain, got)]
    assert changed[0] and changed[1] and not changed[2]


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("kind", [pytest.param("bf16", marks=needs_bf16_kernel),
                                  pytest.param("Q4_1 fp32", marks=needs_quantized_kernel)])
def test_an_8bit_cache_in_one_call(tmp_path, monkeypatch, kind, cache):
    """--kv-cache-dtype int8 and fp8: the one call writes each head's row as
    8-bit steps and its scale exactly as the modules' torch quantization does
    (bit for bit in bf16, where the two compute the same keys; fp8's e4m3
    rounded to nearest even as torch's cast) and attends over them in the
    kernel; in fp32 (the element-wise layers fused, keys that
    differ by fp32 rounding may round to another step) the hidden states
    agree to fp32 rounding with int8, to a step's effect with fp8."""
    from folio.model.attention import kv_quant
    folder = make_tiny_model(tmp_path / "hf", intermediate_size=128)
    if kind == "bf16":
        llm = LLM(folder, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=48,
                  kv_cache_dtype=cache)
    else:
        llm = LLM(write_tiny_gguf(folder, tmp_path / "m.gguf", "Q4_1"), dtype="float32",
                  num_kv_blocks=64, max_num_batched_tokens=48, activation_quantization="none",
                  kv_cache_dtype=cache)
    assert {c.dtype for c in llm.engine.executor.runner.kv_caches} == {
        {"int8": torch.int8, "fp8": torch.uint8}[cache]}
    assert llm.engine.executor.runner.model.model.native_decoder is not None
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    if kind == "bf16":
        assert all(r[2] and r[3] for r in records), records
    else:
        # keys that differ by fp32 rounding may round to the next step: int8's
        # 1/127 of the row's largest, e4m3's an eighth of the value itself
        bound = {"int8": 1e-4, "fp8": 0.1}[cache]
        assert all(hidden < bound for *_, hidden, _ in records), records
        caches = llm.engine.executor.runner.kv_caches
        assert all(torch.isfinite(kv_quant.dequantize(c, torch.float32)).all() for c in caches)


@needs_quantized_kernel
@pytest.mark.parametrize("fixture", ["ct-w8a16-kv-fp8", "ct-w8a16-kv-fp8-head"])
def test_a_checkpoint_s_static_fp8_kv_scales_in_one_call(monkeypatch, fixture):
    """compressed-tensors' kv_cache_scheme (tests/fixtures/quant: a scale per
    layer, or per KV head): with an fp8 cache the one call writes each row
    with its static scale, as the modules do (bit for bit in bf16; where
    bfloat16 runs as fp32, to an e4m3 step's effect)."""
    if not native.fuses(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no bf16 element-wise kernels here")
    from tests.model.quantization.checkpoints import FIXTURES
    llm = LLM(str(FIXTURES / fixture), dtype="bfloat16", num_kv_blocks=64,
              max_num_batched_tokens=48, kv_cache_dtype="fp8")
    decoder = llm.engine.executor.runner.model.model.native_decoder
    assert decoder is not None and decoder.layers[0].self_attn.attn.kv_scales is not None
    records = _record_both_paths(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    if llm.engine.config.dtype == "bfloat16":
        assert all(r[2] and r[3] for r in records), records
    else:       # a CPU without native bf16 runs fp32: keys may round to the next e4m3
        assert all(hidden < 0.1 for *_, hidden, _ in records), records


def test_a_pipeline_stage_carries_the_residual_into_its_one_call(monkeypatch):
    """The default model's layers in two calls (as two pipeline stages run
    them: the second takes the first's residual) equal them in one."""
    from folio.model.attention.backend import StepDescription
    from folio.model.native_decoder import NativeDecoder
    llm = LLM(dtype="float32", num_kv_blocks=32, max_model_len=512,
              activation_quantization="none")
    runner = llm.engine.executor.runner
    model = runner.model.model
    whole = model.native_decoder
    assert whole is not None
    layers = list(model.layers)
    first, second = NativeDecoder.build(layers[:11]), NativeDecoder.build(layers[11:])
    ids = torch.tensor([1, 504, 2683, 359, 253, 5356, 1701, 28])
    step, _ = StepDescription.of_spans([(0, len(ids), torch.arange(2).numpy())],
                                       runner.block_size, runner.device)
    meta = runner.attn_backend.build_metadata(step)
    rope = model.rotary(torch.from_numpy(step.positions))
    caches = [torch.zeros_like(c) for c in runner.kv_caches]
    h, r = whole(model.embed_tokens(ids), rope, caches, meta)
    split_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    h1, r1 = first(model.embed_tokens(ids), rope, split_caches[:11], meta)
    h2, r2 = second(h1, rope, split_caches[11:], meta, r1)
    assert torch.equal(h2, h) and torch.equal(r2, r)
    assert all(torch.equal(a, b) for a, b in zip(split_caches, caches))


# tests/engine/test_moe.py's two families: Mixtral (every layer MoE, weights in
# fp32) and Qwen3-MoE (MoE, dense, MoE; weights in the dtype, not renormalized)
MOE = {"mixtral": dict(arch="mixtral", dialect="v5", num_local_experts=4,
                       num_experts_per_tok=2, intermediate_size=48),
       "qwen3_moe": dict(arch="qwen3_moe", dialect="v5", num_hidden_layers=3, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                         norm_topk_prob=False, head_dim=32),
       # top-8 of 16, as Qwen3-MoE's own configs: eight rows summed per token
       "qwen3_moe_k8": dict(arch="qwen3_moe", dialect="v5", num_hidden_layers=2,
                            num_experts=16, num_experts_per_tok=8, moe_intermediate_size=32,
                            norm_topk_prob=True, head_dim=32)}


@pytest.mark.parametrize("arch", list(MOE))
@pytest.mark.parametrize("kind", [pytest.param("bf16", marks=needs_bf16_kernel),
                                  pytest.param("split", marks=needs_avx2_kernel),
                                  pytest.param("int4 bf16", marks=needs_quantized_kernel),
                                  pytest.param("int4 fp32", marks=needs_quantized_kernel)])
def test_moe_layers_in_one_call_as_in_the_modules(tmp_path, monkeypatch, arch, kind):
    """Mixture-of-experts layers in the one call: the router (moe.c, which a
    bf16 run's modules call too) and each chosen expert once on the step's
    rows that chose it, summed in the modules' order; bit for bit in bf16, to
    fp32 rounding in fp32 (the element-wise layers fused, and the modules'
    router torch's: a near-tie could route otherwise, which these random
    models do not meet; "split": --dtype
    bfloat16 on a CPU without native bf16, every expert kept as bf16 for the
    AVX2 kernel). Steps of one token (one request decoding) and of many
    (prefill chunks beside decodes)."""
    from folio.model.layers.moe import FusedMoE
    if kind == "int4 bf16" and not native.fuses(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no bf16 element-wise kernels here")
    if kind == "split":
        monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    folder = make_tiny_model(tmp_path, **MOE[arch])
    dtype = "float32" if kind.endswith("fp32") else "bfloat16"
    dtype = device.split_cpu_bf16(dtype, "cpu")[0]          # "split": float32
    llm = LLM(folder, dtype="bfloat16" if kind == "split" else dtype, num_kv_blocks=64,
              max_num_batched_tokens=48,
              quantization="int4" if kind.startswith("int4") else None,
              activation_quantization="none" if dtype == "float32" else "int8",
              kv_cache_dtype="float32" if dtype == "float32" else "auto")
    model = llm.engine.executor.runner.model.model
    decoder = model.native_decoder
    assert decoder is not None and decoder.quantized == kind.startswith("int4")
    assert decoder.bf16_weights == (kind == "split")
    assert any(isinstance(layer.mlp, FusedMoE) for layer in decoder.layers)
    records = _record_both_paths(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)]
    llm.generate(prompts, params)
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], params)       # steps of one token
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    assert any(tokens == 1 for tokens, *_ in records)
    if dtype == "bfloat16":
        assert all(r[2] and r[3] for r in records), records
    else:
        assert all(hidden < 1e-4 and cache < 1e-4 for *_, hidden, cache in records), records


@needs_quantized_kernel
def test_moe_layers_leave_the_one_call_where_their_experts_cannot(tmp_path, monkeypatch):
    """Float experts the native kernels do not pack (fp32 here), and experts
    split over tensor-parallel ranks, keep the modules."""
    from folio.model.native_decoder import NativeDecoder
    folder = make_tiny_model(tmp_path, **MOE["mixtral"])
    llm = LLM(folder, dtype="float32", num_kv_blocks=32)
    layers = list(llm.engine.executor.runner.model.model.layers)
    assert layers[0].mlp.packed_experts is None
    assert llm.engine.executor.runner.model.model.native_decoder is None
    llm = LLM(folder, dtype="float32", num_kv_blocks=32, quantization="int4")
    layers = list(llm.engine.executor.runner.model.model.layers)
    assert NativeDecoder.build(layers) is not None
    monkeypatch.setattr(layers[1].mlp, "tp", 2)
    assert NativeDecoder.build(layers) is None


@pytest.mark.skipif(not native.has_fp8_linear(), reason="no fp8 kernel on this machine "
                                                        "(AVX2, FMA and F16C; or no compiler)")
@pytest.mark.parametrize("arch", ["llama", "qwen3", *MOE])
def test_fp8_layers_in_one_call_as_in_the_modules(tmp_path, monkeypatch, arch):
    """-q fp8 (e4m3 weights, fp32 activations): the one call runs every
    projection, and a MoE layer's experts, on native/fp8linear.c as the
    modules do, the element-wise layers fused, so the two agree to fp32
    rounding; steps of one token and of many."""
    from folio.model.layers.quantization.fp8 import Fp8Linear
    shape = MOE[arch] if arch in MOE else {"arch": arch}
    llm = LLM(make_tiny_model(tmp_path, **shape), dtype="float32", num_kv_blocks=64,
              max_num_batched_tokens=48, quantization="fp8", kv_cache_dtype="float32")
    decoder = llm.engine.executor.runner.model.model.native_decoder
    assert decoder is not None and decoder.kind == "fp8" and decoder.fp8
    assert isinstance(decoder.layers[0].self_attn.qkv_proj.quant_method, Fp8Linear)
    records = _record_both_paths(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70, 9, 33)], params)
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], params)
    assert any(decodes and tokens > decodes for tokens, decodes, *_ in records)
    assert any(tokens == 1 for tokens, *_ in records)
    assert all(hidden < 1e-4 and cache < 1e-4 for *_, hidden, cache in records), records


def test_fp8_layers_leave_the_one_call_under_bfloat16(tmp_path):
    """The fp8 kernel takes fp32 activations: a bf16 run keeps the modules (a
    CPU without native bf16 runs --dtype bfloat16 in fp32 arithmetic, which
    the one call takes)."""
    llm = LLM(make_tiny_model(tmp_path), dtype="bfloat16", num_kv_blocks=16, quantization="fp8")
    decoder = llm.engine.executor.runner.model.model.native_decoder
    if llm.engine.config.dtype == "bfloat16":
        assert decoder is None
    else:
        assert decoder is not None and decoder.kind == "fp8"
