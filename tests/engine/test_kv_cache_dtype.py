"""`--kv-cache-dtype bfloat16` under a float32 run (the default dtype on CPUs
without native bf16): keys and values are stored rounded to bf16 and read
widened, so the same memory holds twice the blocks and a decode step streams
half the cache's bytes. What the tests hold it to:

- the pool: exactly twice the blocks of a float32 cache in the same
  `kv_cache_memory_bytes` (the floor of a halved block size), every block back
  after a run under pressure;
- the backends: the native kernel and the torch backend read the same bf16
  cache and give the same greedy tokens, alone, under preemption and after a
  prefix hit;
- the drift: teacher-forced prompt logprobs of the default model (fp32
  arithmetic on its codes) against its float32 cache, mean and max
  |d logprob| bounded (docs/benchmarks.md gives the measured figures);
- the refusals: an unknown dtype, and a cache wider or narrower than a bf16
  run's;
- auto: the dtype asked for, so `--dtype bfloat16` run as float32 arithmetic
  (a CPU without native bf16) keeps a bf16 cache.
"""

import logging

import pytest
import torch

from folio import LLM, SamplingParams
from folio.worker import device
from tests.engine.test_bf16_fast_paths import _scores, drift, greedy_texts
from tests.utils import make_tiny_model

# measured on the default model in fp32 arithmetic (docs/benchmarks.md): mean
# 0.0036, max 0.029 over 124 tokens, a tenth of what int8 activations move it.
# With int8 activations on both sides the difference reads 0.037 / 0.19: a
# value moved by the cache's rounding that crosses an int8 rounding boundary
# moves by a whole step, so that comparison measures int8's own sensitivity.
MEAN_BOUND, MAX_BOUND = 0.008, 0.06


def test_twice_the_blocks_in_the_same_memory(tmp_path, caplog):
    folder = make_tiny_model(tmp_path)
    wide = LLM(folder, dtype="float32", kv_cache_memory_bytes="3MiB")
    with caplog.at_level(logging.INFO, logger="folio"):
        narrow = LLM(folder, dtype="float32", kv_cache_memory_bytes="3MiB",
                     kv_cache_dtype="bfloat16")
    assert narrow.engine.num_blocks in (2 * wide.engine.num_blocks,
                                        2 * wide.engine.num_blocks + 1)
    for llm, dtype in ((wide, torch.float32), (narrow, torch.bfloat16)):
        caches = llm.engine.executor.runner.kv_caches
        assert {c.dtype for c in caches} == {dtype}
        assert sum(c.numel() * c.element_size() for c in caches) <= 3 << 20
    assert any("dtype bfloat16" in r.getMessage() and "KV cache" in r.getMessage()
               for r in caplog.records)
    # the activations stay float32: only the cache is narrower
    assert narrow.engine.config.dtype == "float32"
    assert narrow.engine.config.kv_dtype == "bfloat16"
    wide.shutdown()
    narrow.shutdown()


@pytest.mark.parametrize("backend", ["CPU_NATIVE", "TORCH_SDPA"])
def test_backends_agree_under_pressure_and_after_a_prefix_hit(tmp_path, backend):
    """A pool small enough to preempt, prompts sharing a prefix: the tokens
    of each backend on the bf16 cache equal those of the torch backend on it
    with nothing preempted or shared, and every block comes back."""
    folder = make_tiny_model(tmp_path, max_position_embeddings=512)
    prefix = list(range(10, 42))
    prompts = [{"prompt_token_ids": prefix + [50 + i] * (5 + 7 * i)} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(folder, dtype="float32", kv_cache_dtype="bfloat16", num_kv_blocks=256,
                block_size=8, attention_backend="TORCH_SDPA", enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    roomy.shutdown()
    llm = LLM(folder, dtype="float32", kv_cache_dtype="bfloat16", num_kv_blocks=20,
              block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
              attention_backend=backend)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    again = llm.generate(prompts[:1], params)[0]         # its prefix is cached
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[0]
    assert llm.engine.scheduler.kv.num_free_blocks == 20


def test_default_model_drifts_little_from_its_float32_cache():
    exact_llm = LLM(dtype="float32", num_kv_blocks=128, activation_quantization="none")
    texts = greedy_texts(exact_llm)
    exact = _scores(exact_llm, texts)
    exact_llm.shutdown()
    llm = LLM(dtype="float32", num_kv_blocks=128, kv_cache_dtype="bfloat16",
              activation_quantization="none")
    assert llm.engine.executor.runner.kv_caches[0].dtype == torch.bfloat16
    worst, mean = drift(llm, texts, exact, "bf16 cache - fp32 cache")
    assert 0 < mean <= MEAN_BOUND and worst <= MAX_BOUND


def test_refusals(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, "
                                         "float32, int8, fp8, fp8_e5m2, got 'int4'"):
        LLM(folder, kv_cache_dtype="int4")
    # a bf16 run (forced where the CPU would run bfloat16 as fp32 arithmetic)
    monkeypatch.setattr(device, "split_cpu_bf16", lambda dtype, dev: (dtype, None))
    with pytest.raises(ValueError, match="kv_cache_dtype=float32 under dtype bfloat16"):
        LLM(folder, dtype="bfloat16", kv_cache_dtype="float32")
    same = LLM(folder, dtype="bfloat16", kv_cache_dtype="bfloat16", num_kv_blocks=8)
    assert same.engine.config.cache.kv_cache_dtype is None       # the run's own: auto
    assert same.engine.executor.runner.kv_caches[0].dtype == torch.bfloat16
    same.shutdown()


def test_auto_follows_the_dtype_asked_for_where_bf16_runs_as_fp32(tmp_path, monkeypatch):
    """--dtype bfloat16 on a CPU without native bf16 runs float32 arithmetic on
    bf16 weights; auto keeps the cache in bf16 as asked, float32 widens it."""
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    folder = make_tiny_model(tmp_path)
    for kv, want in (("auto", torch.bfloat16), ("bfloat16", torch.bfloat16),
                     ("float32", torch.float32)):
        llm = LLM(folder, dtype="bfloat16", kv_cache_dtype=kv, num_kv_blocks=8)
        assert (llm.engine.config.dtype, llm.engine.config.weight_dtype) == ("float32",
                                                                             "bfloat16")
        assert llm.engine.executor.runner.kv_caches[0].dtype == want, kv
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        llm.shutdown()


def test_the_flag_reaches_the_engine_and_refuses_unknown_names(capsys):
    from folio.cli import build_parser
    from folio.cli_engine import engine_kwargs
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "bfloat16",
                                       "--prompt", "hi"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "bfloat16"
    assert engine_kwargs(build_parser().parse_args(["serve"]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int3"])
    assert "kv_cache_dtype must be one of auto, bfloat16, float32, int8, fp8, fp8_e5m2, got 'int3'" \
        in capsys.readouterr().err
