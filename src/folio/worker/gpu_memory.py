"""Sizing the KV cache on a GPU by `--gpu-memory-utilization`, as vLLM users
know it: the weights are loaded, one forward at the largest step measures the
peak of the activations, and the KV cache takes what the fraction of the
card's memory leaves. The arithmetic (`plan_kv_cache`) is plain Python and
tested on the CPU; `profile_step` and `measure` need CUDA.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from folio.model.attention.backend import StepDescription

logger = logging.getLogger("folio")
GiB = 1024 ** 3


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    total_bytes: int          # the card's memory
    in_use_bytes: int         # held when sizing: weights, CUDA context, other processes
    activation_bytes: int     # the profiled step's peak, above what stays held
    kv_bytes: int             # num_blocks x bytes per block
    max_concurrency: float    # sequences of max_model_len tokens the blocks hold at once

    def describe(self, utilization: float, max_model_len: int) -> str:
        return (f"GPU memory {self.total_bytes / GiB:.2f} GiB x {utilization:g}: "
                f"{self.in_use_bytes / GiB:.2f} GiB in use (weights and context), "
                f"{self.activation_bytes / GiB:.2f} GiB peak activations, KV cache "
                f"{self.num_blocks} blocks = {self.kv_bytes / GiB:.2f} GiB: "
                f"{self.max_concurrency:.1f}x concurrency at {max_model_len} tokens")


def plan_kv_cache(total_bytes: int, utilization: float, in_use_bytes: int,
                  activation_bytes: int, bytes_per_block: int, block_size: int,
                  max_model_len: int) -> KVPlan:
    """The KV blocks that fit in `utilization` of the card beside what is in use
    and the activations' peak; an error when not even one sequence of
    `max_model_len` tokens fits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - in_use_bytes - activation_bytes
    per_seq = -(-max_model_len // block_size)
    num_blocks = max(budget, 0) // bytes_per_block
    if num_blocks < per_seq:
        need = per_seq * bytes_per_block
        raise ValueError(
            f"the KV cache does not hold one sequence of max_model_len={max_model_len} "
            f"tokens: that needs {need / GiB:.2f} GiB, and {utilization:g} of "
            f"{total_bytes / GiB:.2f} GiB less {in_use_bytes / GiB:.2f} GiB in use and "
            f"{activation_bytes / GiB:.2f} GiB of activations leaves "
            f"{max(budget, 0) / GiB:.2f} GiB; raise --gpu-memory-utilization, lower "
            f"--max-model-len or --max-num-batched-tokens, or use a quantized model")
    return KVPlan(num_blocks=num_blocks, total_bytes=total_bytes, in_use_bytes=in_use_bytes,
                  activation_bytes=activation_bytes, kv_bytes=num_blocks * bytes_per_block,
                  max_concurrency=num_blocks * block_size / max_model_len)


def profile_sequences(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """The prompt lengths of the profiling step: the whole token budget, in
    sequences no longer than the model allows."""
    n, rest = divmod(max_num_batched_tokens, max_model_len)
    return [max_model_len] * n + ([rest] if rest else [])


def profile_forward(runner) -> torch.Tensor:
    """The largest step on a scratch KV cache: the token budget as fresh
    prompts, then the logits of max_num_seqs rows (returned). Any device."""
    config, device, bs = runner.config, runner.device, runner.block_size
    lens = profile_sequences(config.scheduler.max_num_batched_tokens, config.max_model_len)
    tables, start = [], 0
    for n in lens:
        blocks = -(-n // bs)
        tables.append(np.arange(start, start + blocks, dtype=np.int64))
        start += blocks
    pos = [np.arange(n, dtype=np.int64) for n in lens]
    slots = np.concatenate([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)])
    step = StepDescription(query_lens=lens, start_positions=[0] * len(lens), block_tables=tables,
                           slot_mapping=slots, positions=np.concatenate(pos), num_decodes=0,
                           device=device)
    from folio.worker.kv_cache import allocate_kv_caches
    # a pipeline stage: its own layers, on zeros where activations would come in
    scratch = allocate_kv_caches(getattr(runner, "kv_config", config), start,
                                 runner.model.num_kv_heads_per_rank, runner.attn_backend)
    stage = runner.model.stage
    with torch.inference_mode():
        ids = torch.zeros(len(slots), dtype=torch.int64, device=device)
        carried = None if stage.is_first else [
            torch.zeros(len(slots), runner.model.config.hidden_size, dtype=runner.dtype,
                        device=device) for _ in range(runner.model.model.pp_tensors)]
        out = runner.model(ids, torch.from_numpy(step.positions).to(device), scratch,
                           runner.attn_backend.build_metadata(step), carried)
        hidden = out if isinstance(out, torch.Tensor) else out[0]
        if not stage.is_first:          # the LM head is stage 0's
            return hidden
        rows = min(config.scheduler.max_num_seqs, hidden.shape[0])
        return runner.model.compute_logits(hidden[:rows]).float()


def profile_step(runner) -> int:
    """Bytes of the activations' peak in the largest step, above what was
    held before it (CUDA)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    logits = profile_forward(runner)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    del logits
    torch.cuda.empty_cache()
    return peak


def measure(runner, bytes_per_block: int, utilization: float) -> KVPlan:
    """Profile, then plan (CUDA)."""
    activations = profile_step(runner)
    free, total = torch.cuda.mem_get_info(runner.device)
    plan = plan_kv_cache(total, utilization, total - free, activations, bytes_per_block,
                         runner.block_size, runner.config.max_model_len)
    logger.info("%s", plan.describe(utilization, runner.config.max_model_len))
    return plan
