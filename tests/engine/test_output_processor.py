"""Stop strings and text assembly in the output processor, on a tiny model."""

import pytest

from folio import LLM, SamplingParams
from tests.utils import make_tiny_model

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("op"))
    return LLM(path, dtype="float32", num_kv_blocks=32)


def _pieces(llm, ids):
    tok = llm.get_tokenizer()
    return [tok.decode(ids[:i + 1]) for i in range(len(ids))]


def test_stop_string_across_a_token_boundary(llm):
    full = llm.generate("Hello world", SamplingParams(**GREEDY))[0].outputs[0]
    prefixes = _pieces(llm, full.token_ids)
    # A stop string made of the end of one token's text and the start of the next.
    for i in range(3, len(prefixes) - 1):
        a, b = prefixes[i], prefixes[i + 1]
        stop = b[len(a) - 1:len(a) + 1]
        if (len(a) >= 1 and len(b) > len(a) and full.text.startswith(b)
                and full.text.startswith(a) and "\ufffd" not in stop):
            break
    else:
        pytest.skip("no clean token boundary in this sample")
    out = llm.generate("Hello world", SamplingParams(**GREEDY, stop=[stop]))[0].outputs[0]
    cut = full.text.find(stop)
    assert out.text == full.text[:cut] and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


def test_stop_string_never_matching_changes_nothing(llm):
    full = llm.generate("Hello world", SamplingParams(**GREEDY))[0].outputs[0]
    out = llm.generate("Hello world", SamplingParams(**GREEDY, stop=["\u2603\u2603"]))[0].outputs[0]
    assert out.text == full.text and out.finish_reason == "length"


def test_text_equals_decode_of_tokens(llm):
    outs = llm.generate(["The quick", "Paged"], SamplingParams(**GREEDY))
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)


# ---- final-only outputs (offline LLM.generate): no output before the end, and
# the text decoded once where no stop string watches it

def _streamed(llm, prompt, params, n_steps_seen=None):
    """The same request driven step by step with cumulative outputs (the
    server's way): its last RequestOutput, and how many the engine gave."""
    engine = llm.engine
    ids = engine.input_processor.tokenize(prompt)[1]
    engine.add_tokenized_request("streamed", prompt, ids, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "streamed"]
    return outs[-1], len(outs)


@pytest.mark.parametrize("extra", [
    dict(),                                          # text decoded at the end
    dict(ignore_eos=False, max_tokens=64),           # ended by EOS: not in the text
    dict(n=3, temperature=0.9, seed=5),              # three sequences, each its text
    dict(logprobs=2),
    dict(stop=["\u2603"]),                           # stop strings: text as it goes
])
def test_final_only_equals_the_streamed_result(llm, extra):
    params = SamplingParams(**{**GREEDY, **extra})
    final = llm.generate("Hello world", params)[0]
    streamed, count = _streamed(llm, "Hello world", params)
    assert count > 1                    # the streamed request gave one output a step
    assert final.finished and streamed.finished
    for a, b in zip(final.outputs, streamed.outputs, strict=True):
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
            (b.text, b.token_ids, b.finish_reason, b.stop_reason)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)
        assert a.logprobs == b.logprobs
        assert a.text == llm.get_tokenizer().decode(
            a.token_ids[:-1] if a.finish_reason == "stop" else a.token_ids)
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


def test_final_only_gives_one_output_and_an_abort_keeps_the_text(llm):
    engine = llm.engine
    ids = engine.input_processor.tokenize("Hello world")[1]
    engine.add_tokenized_request("final", None, ids, SamplingParams(**GREEDY),
                                 final_only=True)
    for _ in range(5):
        assert engine.step() == []      # running: nothing built for it yet
    (aborted,) = engine.abort_request(["final"])
    out = aborted.outputs[0]
    assert aborted.finished and out.finish_reason == "abort" and len(out.token_ids) == 5
    assert out.text == llm.get_tokenizer().decode(out.token_ids)
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks


def _replay(llm, params, steps, merge):
    """The final output of one request whose core outputs came as `steps`
    (lists of EngineCoreOutput), taken in step by step or merged at once;
    with the (request, sequence) pairs a stop string ended."""
    from folio.engine.output_processor import OutputProcessor, merge_steps
    processor = OutputProcessor(llm.get_tokenizer())
    request = llm.engine.input_processor.make_request("r", [1, 2, 3], params)
    processor.add_request(request, None)
    batches = [merge_steps([o for step in steps for o in step])] if merge else steps
    last, stopped = None, []
    for batch in batches:
        outs, stops = processor.process(batch)
        stopped += stops
        last = outs[-1] if outs else last
    return last, stopped


def test_merged_steps_give_what_the_steps_gave_one_by_one(llm):
    """A front end that fell behind takes several steps' outputs as one
    (merge_steps): the same tokens, text, logprobs and prompt logprobs, the
    same finish, and a stop string inside a merged run ends its sequence
    where it ended step by step (tokens the core made after it dropped)."""
    from folio.core.outputs import EngineCoreOutput
    full = llm.generate("Hello world", SamplingParams(**GREEDY))[0].outputs[0]
    ids = full.token_ids
    texts = _pieces(llm, ids)
    # a stop string that ends inside the run, a few tokens before its end
    cut = next(i for i in range(6, len(ids)) if len(texts[i]) > len(texts[i - 1]) + 1)
    stop = texts[cut][len(texts[cut - 1]) - 1:]
    for params in (SamplingParams(n=2, logprobs=2, prompt_logprobs=1, **GREEDY),
                   SamplingParams(n=2, stop=[stop], **GREEDY)):
        steps = [[EngineCoreOutput("r", 0, [], [], prompt_logprobs=[(-1.5, [(7, -0.5)])])]]
        for i, token in enumerate(ids):
            finish = "length" if i == len(ids) - 1 else None
            steps.append([EngineCoreOutput("r", k, [token], [-0.1 * i - k], finish,
                                           new_top_logprobs=[[(token, -0.1 * i - k)]])
                          for k in range(2)])
        one_by_one, stops_one = _replay(llm, params, steps, merge=False)
        merged, stops_merged = _replay(llm, params, steps, merge=True)
        assert merged.finished and one_by_one.finished
        assert merged.outputs == one_by_one.outputs
        assert merged.prompt_logprobs == one_by_one.prompt_logprobs
        assert sorted(stops_merged) == sorted(stops_one)
        if params.stop:
            assert stops_one and all(c.finish_reason == "stop" for c in merged.outputs)
            assert len(merged.outputs[0].token_ids) < len(ids)
        else:
            assert [c.token_ids for c in merged.outputs] == [ids, ids]
            assert merged.outputs[1].logprobs[3] == {ids[3]: -0.3 - 1}


def test_a_core_output_pickles_with_every_field():
    """EngineCoreOutput's own __reduce__ (what a core process sends each
    step) carries every field, in order: a field added later must be in it."""
    import dataclasses
    import pickle
    from folio.core.outputs import EngineCoreOutput
    fields = dataclasses.fields(EngineCoreOutput)
    values = [f"v{k}" for k in range(len(fields))]       # each field its own value
    back = pickle.loads(pickle.dumps(EngineCoreOutput(*values)))
    assert [getattr(back, f.name) for f in fields] == values
