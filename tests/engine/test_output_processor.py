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
