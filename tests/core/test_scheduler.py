from folio.config import SchedulerConfig
from folio.core.kv_cache_manager import cdiv
from folio.core.scheduler import Scheduler
from folio.request import RequestStatus
from tests.core.fake import FakeRunner, make_request


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256):
    cfg = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget)
    return Scheduler(cfg, num_blocks, block_size)


def step(sched, runner):
    so = sched.schedule()
    for s in so.seqs:    # paging invariant: exactly the blocks the step needs
        assert sched.kv.num_blocks_of(s.seq_id) == cdiv(s.start_pos + len(s.token_ids),
                                                        sched.kv.block_size)
    return so, sched.update_from_output(so, runner.execute(so))


def run_to_end(sched, runner, limit=1000):
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests did not finish")


def test_prefill_is_chunked_by_budget_and_decodes_share_steps():
    sched, runner = make_scheduler(budget=16), FakeRunner()
    sched.add_request(make_request("a", 40, max_tokens=3))
    so, _ = step(sched, runner)
    assert [len(s.token_ids) for s in so.seqs] == [16] and not so.seqs[0].sample
    so, _ = step(sched, runner)
    so, outs = step(sched, runner)
    assert [len(s.token_ids) for s in so.seqs] == [8] and so.seqs[0].sample
    assert len(outs) == 1
    sched.add_request(make_request("b", 10, max_tokens=2))
    so, _ = step(sched, runner)          # a decodes (1 token) while b prefills (10)
    assert sorted(len(s.token_ids) for s in so.seqs) == [1, 10]
    run_to_end(sched, runner)


def test_request_added_while_others_decode_runs_next_step():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", 5, max_tokens=20))
    for _ in range(4):
        step(sched, runner)
    b = make_request("b", 6, max_tokens=2)
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert b.seqs[0].seq_id in [s.seq_id for s in so.seqs]
    run_to_end(sched, runner)


def test_finished_request_blocks_go_to_waiting_one():
    sched, runner = make_scheduler(num_blocks=4, block_size=4), FakeRunner()
    a, b = make_request("a", 12, max_tokens=4), make_request("b", 8, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    a_blocks = set(sched.kv.block_ids(a.seqs[0].seq_id))
    assert b.status == RequestStatus.WAITING          # 3 + 2 blocks do not fit in 4
    while a.seqs[0].status != RequestStatus.FINISHED_LENGTH:
        so, _ = step(sched, runner)
        assert b.seqs[0].seq_id not in [s.seq_id for s in so.seqs]
    so, _ = step(sched, runner)
    assert b.status == RequestStatus.RUNNING
    assert set(sched.kv.block_ids(b.seqs[0].seq_id)) & a_blocks
    run_to_end(sched, runner)


def test_stop_conditions():
    sched, runner = make_scheduler(max_model_len=12), FakeRunner()
    r_len = make_request("len", 10, max_tokens=100)         # stops at max_model_len
    r_max = make_request("max", 3, max_tokens=2)
    sched.add_request(r_len)
    sched.add_request(r_max)
    run_to_end(sched, runner)
    assert r_len.seqs[0].num_output_tokens == 2 and r_len.seqs[0].finish_reason == "length"
    assert r_max.seqs[0].num_output_tokens == 2
    # EOS unless ignore_eos; stop_token_ids always, with stop_reason set
    r_eos = make_request("eos", 3, max_tokens=5)
    first = (r_eos.seqs[0].seq_id * 31 + 3) % 1000        # the token the fake samples first
    r_eos.eos_token_ids = frozenset({first})
    sched.add_request(r_eos)
    run_to_end(sched, runner)
    assert r_eos.seqs[0].output_token_ids == [first]
    assert r_eos.seqs[0].finish_reason == "stop" and r_eos.seqs[0].stop_reason is None


def test_abort_frees_blocks_and_never_reaches_runner_again():
    sched, runner = make_scheduler(), FakeRunner()
    a = make_request("a", 9, max_tokens=50)
    sched.add_request(a)
    sched.add_request(make_request("w", 200))
    step(sched, runner)
    sched.abort_requests(["a", "w", "unknown"])
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    so = sched.schedule()
    assert so.is_empty and a.seqs[0].seq_id in so.finished_seq_ids
    assert not sched.has_unfinished_requests()


def test_preemption_recomputes_and_resumes():
    sched, runner = make_scheduler(num_blocks=6, block_size=4, budget=64), FakeRunner()
    reqs = [make_request(str(i), 6, max_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_end(sched, runner)
    assert sched.num_preemptions > 0
    assert all(r.seqs[0].num_output_tokens == 10 for r in reqs)


def test_request_larger_than_the_pool_is_rejected():
    import pytest
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="whole cache has 2"):
        sched.add_request(make_request("big", 8))


def test_ahead_a_request_preempted_for_priority_waits_for_its_step_in_flight():
    """--async-scheduling: a prompt chunk preempted by a more urgent request
    while its step is in flight is not readmitted by the same schedule (the
    in-flight step's results would publish its blocks against a new table);
    synchronous steps readmit it at once when there is room."""
    for ahead in (False, True):
        cfg = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=12,
                              scheduling_policy="priority", async_scheduling=ahead)
        sched, runner = Scheduler(cfg, 4, 4), FakeRunner()
        low = make_request("low", 12, max_tokens=1, priority=5)
        sched.add_request(low)
        first = sched.schedule()                  # low's whole prompt: 3 of 4 blocks
        assert [len(s.token_ids) for s in first.seqs] == [12]
        high = make_request("high", 8, max_tokens=1, priority=0)
        sched.add_request(high)
        second = sched.schedule()                 # high needs 2 blocks: low preempted
        assert sched.num_preemptions == 1
        ids = {s.seq_id for s in second.seqs}
        assert high.seqs[0].seq_id in ids
        assert (low.seqs[0].seq_id in ids) == (not ahead)
        sched.update_from_output(first, runner.execute(first))
        sched.update_from_output(second, runner.execute(second))
        drain_all(sched, runner)
        assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 4


def drain_all(sched, runner):
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
