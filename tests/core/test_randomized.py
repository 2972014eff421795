"""Seeded random add / abort / step operations against the control plane, with
fake model outputs: after every operation reference counts must equal the
number of block tables holding each block, and no block is both free and held."""

import random
from collections import Counter

import pytest

from folio.config import SchedulerConfig
from folio.core.kv_cache_manager import cdiv
from folio.core.scheduler import Scheduler
from tests.core.fake import FakeRunner, make_request


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    holders = Counter(b.block_id for seq_id, table in kv.tables.items()
                      for b in table[kv._dropped.get(seq_id, 0):])
    for block in sched.kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert sched.kv.pool.is_free(block.block_id) == (block.ref_cnt == 0), block
    for h, block in sched.kv.pool.cached.items():
        assert block.block_hash == h
    live = {s.seq_id for r in sched.requests.values() for s in r.live_seqs}
    assert set(sched.kv.tables) <= live
    for req in sched.running:
        for seq in req.kv_seqs:
            dropped = kv._dropped.get(seq.seq_id, 0)
            assert kv.num_blocks_of(seq.seq_id) == cdiv(req.num_computed_tokens,
                                                        kv.block_size) - dropped
            if kv.window is None:
                assert dropped == 0
                continue
            # never a block the next token's window reaches; at most the blocks
            # a step and the window before it span
            assert dropped <= max(0, req.num_computed_tokens - kv.window + 1) // kv.block_size
            assert kv.num_blocks_of(seq.seq_id) <= kv.most_blocks(
                req.num_computed_tokens + 1, sched.config.max_num_batched_tokens)
    assert len(sched.running) <= sched.config.max_num_seqs
    wasted, allocated = sched.kv.waste((s.seq_id, r.num_computed_tokens)
                                       for r in sched.running for s in r.kv_seqs)
    seqs = sum(len(r.kv_seqs) for r in sched.running)
    assert 0 <= wasted <= seqs * (sched.kv.block_size - 1) and wasted <= allocated


@pytest.mark.parametrize("windowed", [False, True], ids=["all-keys", "window"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_random_operations_keep_the_pool_consistent(seed, windowed):
    """`window`: every layer attends to its last few keys (Mistral's), so
    blocks behind them go back to the pool mid-sequence."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    num_blocks = rng.randint(8, 64)
    cfg = SchedulerConfig(max_model_len=rng.randint(num_blocks * block_size // 2, 2 * num_blocks * block_size),
                          max_num_seqs=rng.randint(1, 12),
                          max_num_batched_tokens=rng.randint(1, 96),
                          long_prefill_token_threshold=rng.choice([0, 0, 8, 32]),
                          scheduling_policy=rng.choice(["fcfs", "priority"]),
                          priority_aging_steps=rng.choice([0, 4, 64]))
    window = rng.randint(1, 3 * block_size) if windowed else None
    sched, runner = Scheduler(cfg, num_blocks, block_size, window=window), FakeRunner(vocab=50)
    next_id, finished, gave_back = 0, 0, False
    for _ in range(1500):
        op = rng.random()
        if op < 0.25:
            prompt = rng.randint(1, min(cfg.max_model_len - 1, 3 * block_size * 4))
            n = rng.choice([1, 1, 1, 2, 3])
            # Half the prompts start with a shared prefix: prefix-cache hits.
            tokens = ([t % 50 for t in range(prompt)] if rng.random() < 0.5
                      else [rng.randrange(50) for _ in range(prompt)])
            req = make_request(str(next_id), prompt, max_tokens=rng.choice([rng.randint(1, 40), None]), n=n,
                               eos=(rng.randrange(50),), ignore_eos=rng.random() < 0.5,
                               prompt=tokens, priority=rng.randint(0, 3))
            next_id += 1
            try:
                sched.add_request(req)
            except ValueError:
                assert sched.kv.most_blocks(prompt + 1, cfg.max_num_batched_tokens) + n - 1 \
                    > num_blocks
        elif op < 0.35 and sched.requests:
            sched.abort_requests([rng.choice(list(sched.requests))])
        else:
            so = sched.schedule()
            assert so.num_batched_tokens <= cfg.max_num_batched_tokens
            outs = sched.update_from_output(so, runner.execute(so))
            finished += sum(o.finish_reason is not None for o in outs)
        check_invariants(sched)
        gave_back = gave_back or any(sched.kv._dropped.values())
    assert gave_back == windowed
    sched.abort_requests(list(sched.requests))
    check_invariants(sched)
    assert sched.kv.num_free_blocks == num_blocks and not sched.kv.tables
    assert finished > 0
    assert sched.prefix_cache_hits > 0
