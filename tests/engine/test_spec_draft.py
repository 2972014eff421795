"""Speculative decoding with a draft model (issue 30): the configuration, the
draft's own cache in the same block budget, and greedy output identical to
decoding without proposals: on tiny random models against transformers
(a draft that is the target itself, whose proposals must all stand, and one
that is another model, whose proposals mostly fail), alone, batched, under
preemption and after a prefix hit; and on the default model with its own
4-bit codes drafting for its float weights, with stops and limits inside
accepted runs, sampled requests and seeds."""

import json

import pytest

from folio import LLM, SamplingParams
from folio.core.spec_decode import parse_speculative_config
from folio.engine.config_builder import build_config
from folio.model.loader import resolve_model_path
from tests.engine.test_spec_decode import COPY, assert_stops_and_limits_as_without
from tests.parity import assert_greedy_parity, reference_greedy
from tests.utils import load_reference_model, make_tiny_model

def _draft(model, **more):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 4, **more}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, the same target as a folder of its own, another model with the
    same vocabulary: one layer, other weights)."""
    root = tmp_path_factory.mktemp("draft")
    return (make_tiny_model(root / "target"), make_tiny_model(root / "copy"),
            make_tiny_model(root / "other", seed=7, num_hidden_layers=1))


# ---- configuration --------------------------------------------------------------

def test_the_config_needs_a_draft_that_fits_the_target(tiny, tmp_path):
    target, _, other = tiny
    c = parse_speculative_config(json.dumps(_draft("x", quantization="int4")))
    assert (c.method, c.model, c.quantization, c.num_speculative_tokens) == \
        ("draft_model", "x", "int4", 4)
    # a draft stops proposing above 16 requests at once unless told otherwise
    assert c.disable_by_batch_size == 16
    assert parse_speculative_config(_draft("x", disable_by_batch_size=64)
                                    ).disable_by_batch_size == 64
    assert parse_speculative_config({"method": "ngram"}).disable_by_batch_size is None
    for bad, message in [
        ({"method": "draft_model"}, 'needs "model"'),
        (_draft(""), 'needs "model"'),
        (_draft("x", prompt_lookup_max=3), "unknown key.*prompt_lookup_max.*draft_model"),
        ({"method": "ngram", "model": "x"}, "unknown key.*model.*method ngram"),
        (_draft("x", quantization=4), "quantization must be a name"),
        (_draft("x", draft={}), "unknown key.*draft"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(bad)
    kw = dict(device="cpu", dtype="float32")
    config = build_config(target, speculative_config=_draft(other), **kw)
    assert config.scheduler.speculative.draft.num_hidden_layers == 1
    for spec, more, message in [
        (_draft(str(tmp_path / "nowhere")), {}, "the draft model .*nowhere"),
        (_draft(other, quantization="q9"), {}, "the draft model .*unknown quantization"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_config(target, speculative_config=spec, **kw, **more)
    short = make_tiny_model(tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ValueError, match="reaches 128 positions, below max_model_len"):
        build_config(target, speculative_config=_draft(short), **kw)
    assert build_config(target, speculative_config=_draft(short), max_model_len=128, **kw)
    wide = make_tiny_model(tmp_path / "wide", vocab_size=4096)
    with pytest.raises(ValueError, match=r"vocabulary \(4096 ids\) is not the target's"):
        build_config(target, speculative_config=_draft(wide), **kw)


def test_the_draft_cache_shares_the_block_budget(tiny):
    """Every block id holds the target's keys and values and the draft's: a
    byte budget buys budget // (target's + draft's bytes per block) blocks."""
    target, _, other = tiny
    budget = 1 << 20
    plain = LLM(target, dtype="float32", kv_cache_memory_bytes=budget)
    spec = LLM(target, dtype="float32", kv_cache_memory_bytes=budget,
               speculative_config=_draft(other))
    runner = spec.engine.executor.runner
    own = plain.engine.executor.runner.bytes_per_block
    # one layer of the same width: half the target's two
    assert runner.drafter.bytes_per_block * 2 == own
    assert runner.bytes_per_block == own + runner.drafter.bytes_per_block
    assert spec.engine.num_blocks == budget // runner.bytes_per_block < plain.engine.num_blocks
    assert all(c.shape[1] == spec.engine.num_blocks for c in runner.drafter.kv_caches)


# ---- greedy parity on tiny models ------------------------------------------------

PROMPTS = [list(range(5, 60)), [9, 8, 7, 6] * 12, list(range(300, 200, -3))]


def _run(llm, prompts, max_tokens=40):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("which", ["itself", "another model"])
def test_greedy_tokens_are_transformers_alone_batched_and_after_a_prefix_hit(tiny, which):
    target, copy, other = tiny
    draft = copy if which == "itself" else other
    llm = LLM(target, dtype="float32", num_kv_blocks=64, speculative_config=_draft(draft))
    sched = llm.engine.scheduler
    alone = _run(llm, PROMPTS[:1])
    batched = _run(llm, PROMPTS)
    again = _run(llm, PROMPTS[:1])          # its prompt's blocks from the prefix cache
    assert llm.engine.scheduler.prefix_cache_hits > 0
    ref_model = load_reference_model(target)
    for ids, out in zip(PROMPTS, batched):
        ref, gaps = reference_greedy(ref_model, ids, 40, ())
        assert_greedy_parity(out, ref, gaps, label=f"draft {which} {len(ids)}")
    assert alone[0] == batched[0] == again[0]
    counts = sched.spec_counts
    assert counts.draft_tokens >= 40
    if which == "itself":
        # the same weights, its own cache kept exactly: every proposal stands
        # (a position the draft skipped or fed twice would cost some)
        assert counts.accepted_tokens == counts.draft_tokens
    else:
        assert counts.acceptance_rate < 0.5
    assert sched.kv.num_free_blocks == 64
    # forgotten as the runner forgets them (the last one finished is told next step)
    runner = llm.engine.executor.runner
    assert runner.drafter.seqs.keys() == runner.states.keys() and len(runner.states) <= 1


def test_a_prefix_hit_on_blocks_the_draft_never_saw(tiny):
    """A seeded sampled request takes no proposals, so the draft never writes
    its prompt's blocks; a greedy request with the same prompt then takes them
    from the prefix cache, and the draft catches up on them from the tokens
    the scheduler sends (every proposal of the target's own weights stands:
    keys and values it lacked would cost some). Steps of 16 tokens: the
    catch-up runs through the draft in pieces of that size."""
    target, copy, _ = tiny
    llm = LLM(target, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              speculative_config=_draft(copy))
    prompt = {"prompt_token_ids": list(range(40, 100))}
    llm.generate(prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=4),
                 use_tqdm=False)
    sched = llm.engine.scheduler
    assert sched.spec_counts.drafts == 0
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens >= 48
    counts = sched.spec_counts
    assert counts.draft_tokens > 0 and counts.accepted_tokens == counts.draft_tokens
    # the draft's blocks of that prompt are now written: a third request needs
    # no catch-up before its own first position
    drafter = llm.engine.executor.runner.drafter
    before = drafter.num_tokens_run
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    assert drafter.num_tokens_run - before < 16


def test_under_preemption(tiny):
    """A cache too small for the batch: preempted sequences are recomputed and
    the draft starts their cache again; the tokens are those without it."""
    target, copy, _ = tiny
    prompts = [p * 2 for p in PROMPTS]
    runs = []
    for spec in (None, _draft(copy)):
        llm = LLM(target, dtype="float32", num_kv_blocks=24, max_model_len=512,
                  speculative_config=spec)
        runs.append(_run(llm, prompts, max_tokens=120))
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.kv.num_free_blocks == 24
    assert runs[0] == runs[1]
    counts = llm.engine.scheduler.spec_counts
    assert counts.accepted_tokens > 0.9 * counts.draft_tokens


# ---- the default model: its 4-bit codes drafting for its float weights ------------

@pytest.fixture(scope="module")
def float_llm():
    return LLM(dtype="float32", quantization="none", num_kv_blocks=256, max_model_len=2048)


@pytest.fixture(scope="module")
def self_draft_llm():
    """The GGUF dequantized to float as the target, the same file's Q4_1 codes
    as the draft, requantized per channel at int4 (a model that differs
    from the target: runs are partly accepted)."""
    path, _ = resolve_model_path(None)
    return LLM(dtype="float32", quantization="none", num_kv_blocks=256, max_model_len=2048,
               speculative_config=_draft(path, quantization="int4"))


def test_the_self_draft_keeps_the_float_models_tokens(float_llm, self_draft_llm):
    sched = self_draft_llm.engine.scheduler
    before = sched.spec_counts
    assert_stops_and_limits_as_without(float_llm, self_draft_llm)
    run = sched.spec_counts.since(before)
    # int4 codes of the same weights: most proposals stand, not all
    assert 0.5 < run.acceptance_rate < 1
    assert sched.kv.num_free_blocks == 256


def test_sampled_requests_verify_the_drafts_and_seeds_keep_their_text(float_llm,
                                                                      self_draft_llm):
    sched = self_draft_llm.engine.scheduler
    before = sched.spec_counts
    sampled = SamplingParams(temperature=0.7, max_tokens=60)
    self_draft_llm.chat(COPY, sampled, use_tqdm=False)
    assert sched.spec_counts.since(before).accepted_tokens > 0
    seeded = SamplingParams(temperature=0.7, seed=5, max_tokens=40)
    assert self_draft_llm.chat(COPY, seeded, use_tqdm=False)[0].outputs[0].token_ids == \
        float_llm.chat(COPY, seeded, use_tqdm=False)[0].outputs[0].token_ids


# ---- sampled proposals drawn from the draft's q; who takes a draft's proposals ----

def test_rejection_sampling_with_the_drafts_own_distribution():
    """Proposals drawn from q: accepting d with min(1, p(d) / q(d)) and drawing
    from max(0, p - q) at a rejection keeps every token distributed as p
    (Pearson's chi-square, 5 degrees of freedom, 20.52 at the 0.001 level,
    fixed seeds); the correction drawn from p itself fails it."""
    import torch

    from folio.model.layers import draws
    from folio.worker.spec_verify import rejection_sample
    p = torch.tensor([[0.10, 0.30, 0.25, 0.15, 0.12, 0.08],
                      [0.30, 0.10, 0.10, 0.20, 0.20, 0.10]])
    q = torch.tensor([[0.40, 0.05, 0.05, 0.30, 0.10, 0.10]])

    def trial(sampler, seed):
        firsts = []
        for t in range(20000):          # each trial a sequence of its own seed
            d = draws.draw_one(q[0], seed + t, 5, draws.DRAFT)
            firsts.append(sampler(p, [d], seed + t, 5, q)[0])
        counts = torch.bincount(torch.tensor(firsts), minlength=6).double()
        expected = p[0].double() * len(firsts)
        return float(((counts - expected) ** 2 / expected).sum())
    assert trial(rejection_sample, 0) < 20.52

    def broken(p, d, seed, first, q):
        if draws.uniform(seed, first, draws.ACCEPT) * q[0, d[0]] < p[0, d[0]]:
            return [d[0]]
        return [draws.draw_one(p[0], seed, first, draws.RESIDUAL)]
    assert trial(broken, 0) > 20.52
    # q all on the proposal is the deterministic case
    sure = torch.tensor([[0., 1., 0.], [0., 0., 1.]])
    assert rejection_sample(sure, [1], 1, 0, torch.tensor([[0., 1., 0.]])) == [1, 2]


def test_a_request_arriving_to_more_load_than_the_limit_takes_no_draft():
    """Admitted with more requests running and waiting than
    disable_by_batch_size, a request never takes a draft's proposals (the
    draft would catch up on its whole context late); within it, it does."""
    from folio.config import SchedulerConfig, SpeculativeConfig
    from folio.core.outputs import ModelRunnerOutput
    from folio.core.scheduler import Scheduler
    from folio.request import Request, Sequence, next_seq_id
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, speculative=(
        SpeculativeConfig("draft_model", 2, disable_by_batch_size=2, model="x")))
    sched = Scheduler(config, 64, 4, True)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20),
                    [Sequence(next_seq_id(), 0, [1, 2, 3], 0)], ()) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()
    assert [r.draft_eligible for r in reqs] == [False, False, False]
    sched.update_from_output(so, ModelRunnerOutput(
        seq_ids=[s.seq_id for s in so.seqs], token_ids=[4] * 3, logprobs=[0.] * 3))
    sched.abort_requests(["r0", "r1"])
    so = sched.schedule()           # one running now, but r2 came in with three
    assert so.seqs[0].spec_token_ids is None
    late = Request("late", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20),
                   [Sequence(next_seq_id(), 0, [1, 2, 3], 0)], ())
    sched.add_request(late)
    sched.update_from_output(so, ModelRunnerOutput(
        seq_ids=[so.seqs[0].seq_id], token_ids=[5], logprobs=[0.]))
    so = sched.schedule()
    assert late.draft_eligible
    sched.update_from_output(so, ModelRunnerOutput(
        seq_ids=[s.seq_id for s in so.seqs], token_ids=[6] * len(so.seqs),
        logprobs=[0.] * len(so.seqs)))
    so = sched.schedule()
    spec = {s.seq_id: s.spec_token_ids for s in so.seqs}
    assert spec[late.seqs[0].seq_id] == [0, 0] and spec[reqs[2].seqs[0].seq_id] is None
    sched.abort_requests(["r2", "late"])


def test_tensor_parallel_2_drafts_alike_on_every_rank(tiny):
    """Two ranks, each running the draft (sharded as the target is) and
    reading what the target kept from the next schedule, not from the
    driver: the greedy tokens are transformers' and every proposal of the
    target's own weights stands; an unseeded sampled request runs through
    rejection sampling on the draft's greedy picks."""
    target, copy, _ = tiny
    llm = LLM(target, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
              speculative_config=_draft(copy))
    try:
        greedy = _run(llm, PROMPTS, max_tokens=24)
        counts = llm.engine.scheduler.spec_counts
        sampled = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(
            temperature=0.8, max_tokens=24, ignore_eos=True), use_tqdm=False)
        after = llm.engine.scheduler.spec_counts.since(counts)
    finally:
        llm.shutdown()
    assert counts.draft_tokens > 0 and counts.accepted_tokens == counts.draft_tokens
    assert len(sampled[0].outputs[0].token_ids) == 24 and after.draft_tokens > 0
    ref_model = load_reference_model(target)
    for ids, out in zip(PROMPTS, greedy):
        ref, gaps = reference_greedy(ref_model, ids, 24, ())
        assert_greedy_parity(out, ref, gaps, label=f"tp2 draft {len(ids)}")

