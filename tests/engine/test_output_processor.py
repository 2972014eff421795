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
