"""Speculative decoding with n-gram proposals (issue 30): the configuration,
the proposer, the runner's greedy verification, the scheduler's bookkeeping
of accepted and rejected tokens (slots, blocks, the prefix cache), and greedy
output identical to decoding without proposals on the default model, alone,
batched, under preemption, after a prefix hit, with stop strings and
max_tokens falling inside an accepted run."""

import json

import pytest
import torch

from folio import LLM, SamplingParams
from folio.bench.texts import ALICE
from folio.config import SchedulerConfig, SpeculativeConfig
from folio.core.outputs import ModelRunnerOutput
from folio.model.layers import draws
from folio.core.scheduler import Scheduler
from folio.core.spec_decode import ngram_propose, parse_speculative_config
from folio.request import Request, Sequence, next_seq_id
from folio.worker.spec_verify import rejection_sample, verify_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
COPY = [{"role": "user", "content": "Repeat this passage exactly:\n\n" + ALICE}]


# ---- configuration --------------------------------------------------------------

def test_the_config_reads_vllms_keys_and_refuses_what_it_cannot_run():
    c = parse_speculative_config(json.dumps(NGRAM))
    assert c == SpeculativeConfig("ngram", 4, 4, 2)
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None
    # one lookup bound given: the other is the same (vLLM's rule)
    assert parse_speculative_config({"prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert parse_speculative_config({"prompt_lookup_min": 6}).prompt_lookup_max == 6
    for bad, message in [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"method": "eagle"}, "method must be one of ngram, draft_model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
        ({"prompt_lookup_max": "4"}, "prompt_lookup_max must be a positive integer"),
        ({"num_speculative_tokens": 17}, "at most 16"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "above prompt_lookup_max"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be a positive"),
        ({"num_spec_tokens": 4}, "unknown key"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(bad)


def test_the_flag_reaches_the_engine(tmp_path):
    from folio.cli import build_parser
    from folio.cli_engine import engine_kwargs
    from folio.engine.config_builder import build_config
    from tests.utils import make_tiny_model
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    config = build_config(make_tiny_model(tmp_path), **dict(engine_kwargs(args),
                                                            device="cpu", dtype="float32"))
    assert config.scheduler.speculative == SpeculativeConfig("ngram", 4, 4, 2)
    with pytest.raises(ValueError, match="unknown key"):
        LLM(str(tmp_path), speculative_config={"k": 1})


# ---- the proposer ---------------------------------------------------------------

def test_ngram_proposals():
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    # the suffix 1 2 3 occurred at the start: what followed it there
    assert ngram_propose(seq, 3, 4, 2) == [4, 5, 9]
    assert ngram_propose(seq, 8, 4, 2) == [4, 5, 9, 9, 1, 2, 3]       # to the end, no further
    # the latest earlier occurrence wins, and longer suffixes before shorter
    seq = [7, 3, 8, 5, 3, 6, 2, 3, 8, 3]
    assert ngram_propose(seq, 2, 2, 1) == [8, 3]          # "8 3" is new; "3" was at index 7
    assert ngram_propose(seq[:-1], 2, 2, 1) == [5, 3]     # "3 8" was at index 1
    assert ngram_propose([5, 3, 8, 4, 3, 8], 2, 2, 1) == [4, 3]         # "3 8", not "8"
    assert ngram_propose([1, 2, 3, 4], 3, 3, 1) == []     # nothing recurs
    assert ngram_propose([1, 2, 3, 4, 2], 3, 3, 2) == []  # "2" recurs, but 2 tokens are asked
    assert ngram_propose([4], 3, 3, 1) == []
    # in a loop the latest occurrence runs into the end: an earlier one that k
    # tokens follow is taken, else the latest
    loop = [1, 2, 1, 2, 1, 2, 1]
    assert ngram_propose(loop, 4, 2, 2) == [2, 1, 2, 1]
    assert ngram_propose(loop, 9, 2, 2) == [2, 1]


# ---- the runner's verification ---------------------------------------------------

def test_verification_keeps_the_proposals_that_stand_and_one_token_after():
    # seq 1 proposed [5, 6, 7]: the model picks 5, then 6, then 9 (not 7), then 4
    # seq 2 had no proposals; seq 3 proposed [8]: the model disagrees at once
    out = ModelRunnerOutput(seq_ids=[1, 1, 1, 1, 2, 3, 3], token_ids=[5, 6, 9, 4, 11, 2, 8],
                            logprobs=[-.1, -.2, -.3, -.4, -.5, -.6, -.7],
                            top_logprobs=[[(5, -.1)], None, None, None, None, None, None])
    verify_greedy(out, {1: [5, 6, 7], 3: [8]})
    assert out.seq_ids == [1, 1, 1, 2, 3] and out.token_ids == [5, 6, 9, 11, 2]
    assert out.logprobs == [-.1, -.2, -.3, -.5, -.6] and out.top_logprobs[0] == [(5, -.1)]
    every = ModelRunnerOutput(seq_ids=[4, 4, 4], token_ids=[3, 3, 7], logprobs=[0., 0., 0.])
    verify_greedy(every, {4: [3, 3]})                  # all stand: k + 1 tokens
    assert every.token_ids == [3, 3, 7]


def _chi_square(sampler, probs, drafts, trials=20000, seed=0):
    """Pearson's statistic of the first kept token against probs[0], and of the
    second against probs[1] among the trials that kept d1 first."""
    firsts, seconds = [], []
    for t in range(trials):             # each trial a sequence of its own seed
        kept = sampler(probs, drafts, seed + t, 40)
        firsts.append(kept[0])
        if kept[0] == drafts[0] and len(kept) > 1:
            seconds.append(kept[1])

    def stat(observed, p):
        counts = torch.bincount(torch.tensor(observed), minlength=len(p)).double()
        expected = p.double() * len(observed)
        return float(((counts - expected) ** 2 / expected).sum())
    return stat(firsts, probs[0]), stat(seconds, probs[1])


def test_rejection_sampling_keeps_the_target_distribution():
    """Six tokens, a proposal the target gives 0.3 after the decode token and a
    second it gives 0.5: the first kept token is distributed as the target's
    first row and the second, after an accepted first, as its second row
    (Pearson's chi-square, 5 degrees of freedom, critical value 20.52 at the
    0.001 level, fixed seeds). Drawing the correction from p instead of the
    residual p without the proposal fails the same test."""
    probs = torch.tensor([[0.10, 0.30, 0.25, 0.15, 0.12, 0.08],
                          [0.05, 0.10, 0.50, 0.15, 0.10, 0.10],
                          [0.30, 0.10, 0.10, 0.20, 0.20, 0.10]])
    drafts = [1, 2]
    first, second = _chi_square(rejection_sample, probs, drafts)
    assert first < 20.52 and second < 20.52

    def broken(p, d, seed, first):       # the correction step drawn from p itself
        kept = []
        for i, tok in enumerate(d):
            if draws.uniform(seed, first + i, draws.ACCEPT) < p[i, tok]:
                kept.append(tok)
                continue
            return kept + [draws.draw_one(p[i], seed, first + i, draws.RESIDUAL)]
        return kept + [draws.draw_one(p[len(d)], seed, first + len(d), draws.SAMPLE)]
    assert _chi_square(broken, probs, drafts)[0] > 20.52
    # every proposal stands where the target is certain of it; none where it
    # gives it nothing
    sure = torch.tensor([[0., 1., 0.], [0., 0., 1.], [1., 0., 0.]])
    assert rejection_sample(sure, [1, 2], 1, 0) == [1, 2, 0]
    assert rejection_sample(sure, [0, 2], 1, 0) == [1]


# ---- the scheduler's bookkeeping ------------------------------------------------

def _scheduler(num_blocks=16, block_size=4, budget=64, caching=True, **spec):
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=budget,
                             speculative=SpeculativeConfig(**{**dict(
                                 num_speculative_tokens=6, prompt_lookup_max=3,
                                 prompt_lookup_min=1), **spec}))
    return Scheduler(config, num_blocks, block_size, caching)


def _request(rid: str, prompt: list[int], params: SamplingParams) -> Request:
    return Request(rid, prompt, params, [Sequence(next_seq_id(), 0, prompt, 0)], ())


def _step(sched, so, picks: dict[int, list[int]]) -> None:
    out = ModelRunnerOutput()
    for s in so.seqs:
        for t in picks.get(s.seq_id, [9]):
            out.seq_ids.append(s.seq_id)
            out.token_ids.append(t)
            out.logprobs.append(0.0)
    sched.update_from_output(so, out)


def test_rejected_slots_go_back_and_only_accepted_tokens_are_cached():
    sched = _scheduler()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    req = _request("r", prompt, params)
    sched.add_request(req)
    seq = req.seqs[0]
    so = sched.schedule()
    assert so.seqs[0].spec_token_ids is None             # a prefill proposes nothing
    _step(sched, so, {seq.seq_id: [4]})                  # it samples 4: "2 3 4" recurs
    assert seq.token_ids[-1] == 4 and req.num_computed_tokens == 10
    so = sched.schedule()
    (s,) = so.seqs
    assert s.spec_token_ids == [5, 6, 7, 1, 2, 3] and s.token_ids == [4, 5, 6, 7, 1, 2, 3]
    assert so.num_batched_tokens == 7
    blocks_before = sched.kv.num_blocks_of(seq.seq_id)
    assert blocks_before == 5                            # 17 slots: positions 10 .. 16
    # the model agrees on 5 and 6, then says 8: 5, 6 accepted, 8 sampled (the
    # entries verify_greedy leaves)
    _step(sched, so, {s.seq_id: [5, 6, 8]})
    assert seq.token_ids[10:] == [4, 5, 6, 8] and req.num_computed_tokens == 13
    assert sched.spec_counts.draft_tokens == 6 and sched.spec_counts.accepted_tokens == 2
    # 14 tokens to hold next step (13 computed, 8 to write): 4 blocks, the 5th went back
    assert sched.kv.num_blocks_of(seq.seq_id) == 4
    # published: the 3 full blocks of computed tokens (12 of the 13), nothing of 8 or 0
    table = sched.kv.tables[seq.seq_id]
    assert [b.block_hash is not None for b in table] == [True, True, True, False]
    # the runner is sent the whole table again, since it lost a block
    so = sched.schedule()
    assert so.seqs[0].block_ids == [b.block_id for b in table] + so.seqs[0].new_block_ids
    _step(sched, so, {so.seqs[0].seq_id: [0]})
    sched.abort_requests(["r"])
    assert sched.kv.num_free_blocks == 16


def test_no_proposals_past_max_tokens_with_prompt_logprobs_or_for_a_seed():
    sched = _scheduler()
    prompt = [1, 2, 1, 2, 1, 2, 1, 2]
    greedy = _request("g", prompt, SamplingParams(temperature=0, max_tokens=3))
    sampled = _request("s", prompt, SamplingParams(temperature=0.8, max_tokens=9))
    penalized = _request("p", prompt, SamplingParams(temperature=0, repetition_penalty=1.2,
                                                     prompt_logprobs=1))
    seeded = _request("x", prompt, SamplingParams(temperature=0.8, seed=1))
    reqs = (greedy, sampled, penalized, seeded)
    for r in reqs:
        sched.add_request(r)
    _step(sched, sched.schedule(), {r.seqs[0].seq_id: [1] for r in reqs})
    so = sched.schedule()
    spec = {s.seq_id: s.spec_token_ids for s in so.seqs}
    # 1 of 3 tokens out: at most 1 proposal (+ the token after it) keeps within 3
    assert spec[greedy.seqs[0].seq_id] == [2]
    assert spec[sampled.seqs[0].seq_id] == [2, 1, 2, 1, 2, 1]
    assert spec[penalized.seqs[0].seq_id] is None       # prompt logprobs: none
    # a seed's text must not depend on what else runs, and proposals do
    assert spec[seeded.seqs[0].seq_id] is None
    _step(sched, so, {})
    sched.abort_requests(["g", "s", "p", "x"])


def test_proposals_take_only_the_budget_every_decode_leaves():
    """Four decodes that could each carry 6 proposals, a budget of 16 tokens:
    every decode runs, and the proposals share the 12 tokens left."""
    sched = _scheduler(num_blocks=64, budget=16)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    reqs = [_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=20))
            for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    while any(r.num_computed_tokens < len(prompt) for r in reqs):     # chunked prefills
        so = sched.schedule()
        _step(sched, so, {s.seq_id: [6] for s in so.seqs if s.sample})
    so = sched.schedule()
    assert sorted(s.seq_id for s in so.seqs) == sorted(r.seqs[0].seq_id for r in reqs)
    assert so.num_batched_tokens == 16 and so.num_preempted == 0
    assert sum(len(s.spec_token_ids or ()) for s in so.seqs) == 12
    _step(sched, so, {})
    sched.abort_requests([r.request_id for r in reqs])


def test_proposals_never_take_a_block_a_decode_needs():
    """One block free. A's decode fits its last block and could carry
    proposals into a new one; B's decode needs a new block. B gets it, A
    carries nothing, and nobody is preempted."""
    sched = _scheduler(num_blocks=5, budget=16, caching=False)
    a = _request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(temperature=0, max_tokens=20))
    b = _request("b", list(range(10, 18)), SamplingParams(temperature=0, max_tokens=20))
    for r in (a, b):
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_batched_tokens == 15                   # both prompts in one step
    _step(sched, so, {a.seqs[0].seq_id: [2], b.seqs[0].seq_id: [20]})
    assert sched.kv.num_free_blocks == 1
    so = sched.schedule()
    spec = {s.seq_id: s.spec_token_ids for s in so.seqs}
    assert set(spec) == {a.seqs[0].seq_id, b.seqs[0].seq_id} and so.num_preempted == 0
    assert spec[a.seqs[0].seq_id] is None and sched.kv.num_free_blocks == 0
    _step(sched, so, {})
    sched.abort_requests(["a", "b"])


def test_a_request_whose_proposals_all_fail_backs_off():
    """A run wholly rejected: the next two decodes go without proposals (then
    4, 8, .. 32 after further misses); an accepted proposal resets that."""
    sched = _scheduler()
    req = _request("r", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3],
                   SamplingParams(temperature=0, max_tokens=50))
    sched.add_request(req)
    sid = req.seqs[0].seq_id
    _step(sched, sched.schedule(), {sid: [4]})
    carried = []
    for _ in range(6):
        so = sched.schedule()
        drafts = so.seqs[0].spec_token_ids
        carried.append(drafts is not None)
        # the model rejects the first run, then accepts the first proposal of each
        _step(sched, so, {sid: [1] if len(carried) == 1 or not drafts else drafts[:1] + [2]})
    assert carried == [True, False, False, True, True, True]
    assert (req.spec_misses, req.spec_wait) == (0, 0)
    sched.abort_requests(["r"])


@pytest.mark.parametrize("limit, proposes", [(1, False), (2, True)])
def test_disable_by_batch_size(limit, proposes):
    sched = _scheduler(disable_by_batch_size=limit)
    for rid in "ab":
        sched.add_request(_request(rid, [1, 2, 1, 2, 1, 2], SamplingParams(temperature=0)))
    so = sched.schedule()
    _step(sched, so, {s.seq_id: [1] for s in so.seqs})
    so = sched.schedule()           # two running: proposals only where 2 are allowed
    assert all((s.spec_token_ids is not None) == proposes for s in so.seqs)
    _step(sched, so, {s.seq_id: [1] for s in so.seqs})
    sched.abort_requests(["a", "b"])


# ---- the engine on the default model ----------------------------------------------

@pytest.fixture(scope="module")
def spec_llm():
    return LLM(dtype="float32", num_kv_blocks=256, max_model_len=2048,
               activation_quantization="none", speculative_config=NGRAM)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_are_those_without_proposals(default_llm, spec_llm):
    params = SamplingParams(temperature=0, max_tokens=120)
    chats = [COPY, [{"role": "user", "content": "Name three colours."}], COPY[:1]]
    plain = _ids(default_llm.chat(chats, params, use_tqdm=False))
    sched = spec_llm.engine.scheduler
    drafts = sched.spec_counts.draft_tokens
    alone = _ids(spec_llm.chat(chats[:1], params, use_tqdm=False))
    batched = _ids(spec_llm.chat(chats, params, use_tqdm=False))
    assert alone[0] == plain[0] and batched == plain
    accepted = sched.spec_counts.accepted_tokens
    assert sched.spec_counts.draft_tokens > drafts and accepted > 0.8 * len(plain[0])
    # a prefix hit: the same prompt again, its blocks from the cache
    again = spec_llm.chat(COPY, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == plain[0]


def test_stops_and_limits_inside_an_accepted_run(default_llm, spec_llm):
    assert_stops_and_limits_as_without(default_llm, spec_llm)


def assert_stops_and_limits_as_without(plain, spec):
    """max_tokens, stop strings (with and without the stop in the text) and
    logprobs: the same with proposals as without, on the copying prompt."""
    for params in [SamplingParams(temperature=0, max_tokens=37),
                   SamplingParams(temperature=0, max_tokens=100, stop=["peeped"]),
                   SamplingParams(temperature=0, max_tokens=100, stop=["the bank"],
                                  include_stop_str_in_output=True),
                   SamplingParams(temperature=0, max_tokens=40, logprobs=2)]:
        want = plain.chat(COPY, params, use_tqdm=False)[0].outputs[0]
        got = spec.chat(COPY, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        if params.logprobs:
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_sampled_requests_take_proposals_and_seeded_ones_keep_their_text(spec_llm,
                                                                        default_llm):
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=80, logprobs=1)
    sched = spec_llm.engine.scheduler
    before = sched.spec_counts.accepted_tokens
    # four unseeded samples (one alone may wander off the passage at once,
    # where no n-gram recurs)
    outs = [o.outputs[0] for o in spec_llm.chat([COPY] * 4, params, use_tqdm=False)]
    assert sched.spec_counts.accepted_tokens > before
    # a seeded request: no proposals, the text it has without them
    seeded = SamplingParams(temperature=0.7, top_p=0.95, seed=42, max_tokens=40)
    before = sched.spec_counts.draft_tokens
    got = spec_llm.chat(COPY, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert got == default_llm.chat(COPY, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert sched.spec_counts.draft_tokens == before
    assert all(len(lp) >= 1 and t in lp for a in outs for t, lp in zip(a.token_ids, a.logprobs))
    assert spec_llm.engine.scheduler.kv.num_free_blocks == 256


def test_structured_outputs_take_proposals_the_grammar_allows(default_llm, spec_llm):
    """A JSON schema: each row of a proposal run is masked to what the grammar
    allows after the proposals before it, so the output is the one without
    proposals, and valid; proposals the grammar refuses are never kept."""
    schema = {"type": "object", "properties": {"title": {"type": "string"},
                                               "year": {"type": "integer"}},
              "required": ["title", "year"]}
    record = '{"title": "Alice\'s Adventures in Wonderland", "year": 1865}'
    chats = [[{"role": "user", "content": f"Repeat this JSON exactly: {record}"}],
             [{"role": "user", "content": "Repeat exactly: the year 1865, the year 1865"}]]
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs={"json": schema})
    want = [o.outputs[0] for o in default_llm.chat(chats, params, use_tqdm=False)]
    sched = spec_llm.engine.scheduler
    before = sched.spec_counts.accepted_tokens, sched.spec_counts.draft_tokens
    got = [o.outputs[0] for o in spec_llm.chat(chats, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g in got:
        value = json.loads(g.text)
        assert isinstance(value["title"], str) and isinstance(value["year"], int)
    assert sched.spec_counts.accepted_tokens > before[0]
    # the second prompt's proposals ("the year ...") are not JSON: refused ones
    assert sched.spec_counts.draft_tokens - before[1] > sched.spec_counts.accepted_tokens - before[0]


def test_penalties_and_min_tokens_see_the_proposals_before_each_row(default_llm, spec_llm):
    """Penalties and min_tokens read the tokens before each row: a proposal
    run's row j sees the j proposals before it, so the tokens are those
    decoded one at a time. min_tokens one short of where the model ends by
    itself puts that EOS in the middle of a run, where a row that did not
    count the proposals before it would still mask EOS."""
    natural = len(default_llm.chat(COPY, SamplingParams(temperature=0, max_tokens=300),
                                   use_tqdm=False)[0].outputs[0].token_ids)
    for params in [SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.03),
                   SamplingParams(temperature=0, max_tokens=60, frequency_penalty=0.05,
                                  presence_penalty=0.05),
                   SamplingParams(temperature=0, max_tokens=natural + 20,
                                  min_tokens=natural - 1)]:
        sched = spec_llm.engine.scheduler
        before = sched.spec_counts.accepted_tokens
        want = default_llm.chat(COPY, params, use_tqdm=False)[0].outputs[0].token_ids
        got = spec_llm.chat(COPY, params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want, params
        assert sched.spec_counts.accepted_tokens > before, params


def test_under_preemption():
    """A cache too small for the batch: requests are preempted and recomputed
    with proposals on, and the tokens are still those without them."""
    params = SamplingParams(temperature=0, max_tokens=100)
    chats = [COPY] * 3
    runs = []
    for spec in (None, NGRAM):
        llm = LLM(dtype="float32", num_kv_blocks=40, max_model_len=1024,
                  activation_quantization="none", speculative_config=spec)
        outs = llm.chat(chats, params, use_tqdm=False)
        runs.append(_ids(outs))
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.kv.num_free_blocks == 40
    assert runs[0] == runs[1]


# ---- served: the flag, the openai client, /metrics, the periodic log -------------

def test_served_with_proposals_counts_them_in_metrics(tmp_path, capsys):
    from folio.cli import main
    from openai import OpenAI

    from tests.server.conftest import ServerProcess
    from tests.server.test_lifecycle import metrics
    server = ServerProcess(["--dtype", "float32", "--activation-quantization", "none",
                            "--num-kv-blocks", "128", "--max-model-len", "1024",
                            "--speculative-config", json.dumps(NGRAM)])
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=COPY, max_tokens=60,
                                               temperature=0)
        assert reply.choices[0].message.content.startswith("Alice was beginning")
        m = metrics(server)
        drafted = m["folio:spec_decode_num_draft_tokens_total"]
        accepted = m["folio:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= drafted and m["folio:spec_decode_num_drafts_total"] > 0
        assert m["folio:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
        assert m["folio:spec_decode_mean_accepted_length"] > 1
        # folio bench serve reads the counters around its run
        data = tmp_path / "copy.jsonl"
        data.write_text(json.dumps({"prompt": COPY[0]["content"], "max_tokens": 40}) + "\n")
        assert main(["bench", "serve", "--base-url", server.url, "--dataset", str(data),
                     "--num-prompts", "1", "--endpoint", "/v1/chat/completions",
                     "--json"]) == 0
        run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
        assert 0 < run["spec_decode"]["num_accepted_tokens"] <= \
            run["spec_decode"]["num_draft_tokens"]
    finally:
        server.stop()


def test_bench_serve_reads_vllms_counters_too():
    from folio.bench.serve import spec_decode_run, spec_decode_totals
    text = "\n".join(f"# TYPE vllm:spec_decode_{n}_total counter\n"
                     f'vllm:spec_decode_{n}_total{{model_name="m"}} {v}'
                     for n, v in (("num_drafts", 10), ("num_draft_tokens", 40),
                                  ("num_accepted_tokens", 30))) + "\n"
    after = spec_decode_totals(text)
    assert after == (10, 40, 30) and spec_decode_totals("") is None
    run = spec_decode_run((5, 20, 10), after)
    assert run == {"num_draft_tokens": 20, "num_accepted_tokens": 20, "acceptance_rate": 1.0,
                   "mean_accepted_length": 5.0}


def test_the_periodic_log_line(caplog):
    import logging

    from folio.engine.stats import StepStats
    from folio.server.metrics import ServerMetrics
    now = [0.0]
    m = ServerMetrics("m", log_interval=10, clock=lambda: now[0])

    def stats(drafted, accepted):
        return StepStats(num_running=1, num_waiting=2, kv_cache_usage=0.25, kv_cache_waste=0,
                         num_preemptions=0, prefix_cache_queries=100, prefix_cache_hits=40,
                         spec_num_drafts=drafted // 4, spec_num_draft_tokens=drafted,
                         spec_num_accepted_tokens=accepted)
    with caplog.at_level(logging.INFO, logger="folio"):
        m.on_step(stats(8, 6), [])
        now[0] = 5.0
        m.on_step(stats(12, 8), [])
        assert not caplog.records                  # under 10 s: nothing yet
        now[0] = 10.0
        m.on_step(stats(40, 30), [])
    (record,) = caplog.records
    assert ("running 1, waiting 2, KV cache usage 25.0%, prefix cache hit rate 40.0%, "
            "speculative acceptance 75.0% (24 of 32 proposed)") in record.getMessage()


def test_tensor_parallel_2_verifies_on_every_rank(tmp_path):
    """Two ranks: the LM head over the proposals' rows is collective, the
    verification the driver's; greedy tokens are transformers' (a tiny random
    model; prompts holding most of its vocabulary, so that whatever it says
    occurred before and one-token lookups propose what followed), and a
    seeded sampled request runs through rejection sampling."""
    from tests.parity import assert_greedy_parity, reference_greedy
    from tests.utils import load_reference_model, make_tiny_model
    folder = make_tiny_model(tmp_path)
    ref_model = load_reference_model(folder)
    prompts = [list(range(5, 384)), list(range(383, 100, -1))]
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
              speculative_config={**NGRAM, "prompt_lookup_min": 1})
    try:
        greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)
        sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
        a, b = (llm.generate({"prompt_token_ids": prompts[0]}, sampled,
                             use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
        assert a == b and len(a) == 24
        assert llm.engine.scheduler.spec_counts.draft_tokens > 0
    finally:
        llm.shutdown()
    for ids, out in zip(prompts, greedy):
        ref, gaps = reference_greedy(ref_model, ids, 24, ())
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=f"tp2 spec {len(ids)}")
