"""The scheduler under pressure: chunked prefill beside decodes, whole-prompt mode,
priorities with preemption, and no starvation."""

import pytest

from folio.config import SchedulerConfig
from folio.core.scheduler import Scheduler
from folio.request import RequestStatus
from tests.core.fake import FakeRunner, drain, make_request, step


def make(num_blocks=512, block_size=16, budget=256, max_num_seqs=8, **kw):
    cfg = SchedulerConfig(max_model_len=4096, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, **kw)
    return Scheduler(cfg, num_blocks, block_size), FakeRunner()


def test_decodes_get_a_token_every_step_while_a_long_prompt_prefills():
    sched, runner = make(budget=256)
    decoders = [make_request(f"d{i}", 10, max_tokens=500) for i in range(4)]
    for r in decoders:
        sched.add_request(r)
    step(sched, runner)                                   # their prompts
    long = make_request("long", 2000, max_tokens=4)
    sched.add_request(long)
    steps = 0
    while long.num_computed_tokens < 2000:
        so = step(sched, runner)
        by_seq = {s.seq_id: s for s in so.seqs}
        for r in decoders:
            assert len(by_seq[r.seqs[0].seq_id].token_ids) == 1      # a token, every step
        assert so.num_batched_tokens <= 256
        steps += 1
    assert steps == -(-2000 // (256 - 4))                # the rest of each budget went to it
    sched.abort_requests([r.request_id for r in decoders] + ["long"])


def test_long_prefill_threshold_lets_prompts_progress_together():
    sched, runner = make(budget=256, long_prefill_token_threshold=64)
    a, b = make_request("a", 600, max_tokens=1), make_request("b", 600, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    so = step(sched, runner)
    assert sorted(len(s.token_ids) for s in so.seqs) == [64, 64]
    drain(sched, runner)


def test_without_chunked_prefill_prompts_run_whole_or_are_refused():
    sched, runner = make(budget=256, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        sched.add_request(make_request("big", 300))
    a, b = make_request("a", 200, max_tokens=2), make_request("b", 100, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    so = step(sched, runner)
    assert [len(s.token_ids) for s in so.seqs] == [200]   # b waits rather than split
    so = step(sched, runner)
    assert sorted(len(s.token_ids) for s in so.seqs) == [1, 100]
    drain(sched, runner)


def test_high_priority_arrival_preempts_and_runs_first():
    sched, runner = make(num_blocks=12, block_size=4, budget=64, max_num_seqs=2,
                         scheduling_policy="priority")
    low = [make_request(f"low{i}", 16, max_tokens=30, priority=5) for i in range(3)]
    for r in low:
        sched.add_request(r)
    step(sched, runner)
    assert [r.status for r in low] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING]
    urgent = make_request("urgent", 16, max_tokens=3, priority=0)
    sched.add_request(urgent)
    so = step(sched, runner)
    assert urgent.status == RequestStatus.RUNNING
    assert urgent.seqs[0].seq_id in {s.seq_id for s in so.seqs}
    assert so.num_preempted >= 1 and low[1].status == RequestStatus.PREEMPTED  # latest, lowest
    assert sched.waiting.peek() is low[1] or sched.waiting.peek() is low[2]
    while not urgent.is_finished:
        step(sched, runner)
    assert not low[2].seqs[0].output_token_ids        # older low-priority one still waits
    drain(sched, runner)
    assert all(r.seqs[0].num_output_tokens == 30 for r in low)


def test_priority_aging_prevents_starvation():
    sched, runner = make(budget=64, max_num_seqs=1, scheduling_policy="priority",
                         priority_aging_steps=4)
    patient = make_request("patient", 8, max_tokens=1, priority=10)
    sched.add_request(patient)
    # The running slot is refilled by a more urgent request every step...
    for i in range(200):
        urgent = make_request(f"u{i}", 8, max_tokens=1)
        sched.add_request(urgent)
        step(sched, runner)
        if patient.is_finished:
            break
    # ...yet the patient request ran, after about priority x aging_steps steps.
    assert patient.is_finished and i < 10 * 4 + 10
    sched.abort_requests(list(sched.requests))


def test_fcfs_head_of_line_is_never_overtaken():
    sched, runner = make(num_blocks=20, block_size=4, budget=64, max_num_seqs=8)
    hog = make_request("hog", 40, max_tokens=20)        # holds 15 of 20 blocks at the end
    sched.add_request(hog)
    step(sched, runner)
    big = make_request("big", 40, max_tokens=1)          # needs 11 blocks: waits
    small = make_request("small", 4, max_tokens=1)       # would fit, but arrived later
    sched.add_request(big)
    sched.add_request(small)
    while not big.status == RequestStatus.RUNNING and not big.is_finished:
        step(sched, runner)
        assert small.status == RequestStatus.WAITING or big.status != RequestStatus.WAITING
    drain(sched, runner)
