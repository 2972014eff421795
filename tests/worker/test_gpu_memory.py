"""KV sizing by --gpu-memory-utilization: the arithmetic and the profiling
step run here; the CUDA measurement around them needs a GPU."""

import pytest
import torch

from folio.worker.gpu_memory import GiB, plan_kv_cache, profile_forward, profile_sequences
from tests.utils import make_tiny_model


def test_the_kv_cache_takes_what_the_fraction_leaves():
    # an 80 GiB card at 0.9: 72 GiB, less 16 GiB held and 2 GiB of activations
    per_block = 2 * 32 * 16 * 8 * 128 * 2          # Llama-3-8B bf16, block 16: 2 MiB
    plan = plan_kv_cache(80 * GiB, 0.9, 16 * GiB, 2 * GiB, per_block, 16, 8192)
    assert plan.num_blocks == 54 * GiB // per_block == 27648
    assert plan.kv_bytes == 54 * GiB
    assert plan.max_concurrency == pytest.approx(27648 * 16 / 8192)
    line = plan.describe(0.9, 8192)
    assert "27648 blocks = 54.00 GiB" in line and "54.0x concurrency at 8192 tokens" in line


def test_not_even_one_sequence_is_a_clear_error():
    per_block = 2 * 1024 ** 2
    # 0.5 of 24 GiB less 11 GiB held and 0.5 GiB: 0.5 GiB, 256 blocks < 512 for 8192 tokens
    with pytest.raises(ValueError, match=r"does not hold one sequence of max_model_len=8192 "
                                         r"tokens: that needs 1.00 GiB.*leaves 0.50 GiB; raise "
                                         r"--gpu-memory-utilization"):
        plan_kv_cache(24 * GiB, 0.5, 11 * GiB, GiB // 2, per_block, 16, 8192)
    assert plan_kv_cache(24 * GiB, 0.5, 11 * GiB, GiB // 2, per_block, 16, 4096).num_blocks == 256
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        plan_kv_cache(24 * GiB, 1.5, 0, 0, per_block, 16, 16)


def test_the_profiled_step_is_the_whole_token_budget():
    assert profile_sequences(2048, 8192) == [2048]
    assert profile_sequences(8192, 2048) == [2048] * 4
    assert profile_sequences(5000, 2048) == [2048, 2048, 904]


def test_the_profiling_forward_runs_the_largest_step(tmp_path):
    """The scratch step is a valid batch of prompts: on the CPU it runs through
    the real model (the memory counters around it are CUDA's)."""
    from folio.engine.config_builder import build_config
    from folio.worker.model_runner import ModelRunner
    config = build_config(make_tiny_model(tmp_path), dtype="float32", device="cpu",
                          num_kv_blocks=8, max_model_len=96, max_num_batched_tokens=200,
                          max_num_seqs=5)
    runner = ModelRunner(config)
    logits = profile_forward(runner)
    assert logits.shape == (5, 384) and torch.isfinite(logits).all()


def test_the_utilization_is_checked_before_loading(tmp_path):
    from folio import LLM
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(make_tiny_model(tmp_path), gpu_memory_utilization=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device's memory")
def test_sizing_on_a_gpu(tmp_path):
    from folio import LLM
    llm = LLM(make_tiny_model(tmp_path), device="cuda", gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    assert llm.engine.scheduler.kv.pool.num_blocks > 0 and free > 0.3 * total
