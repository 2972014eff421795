"""Structured outputs in the engine (offline API): every sample matches its
JSON schema, regex or choice; the logits mask allows exactly what the
grammar's matcher accepts; unconstrained rows of a mixed batch are untouched;
the matcher follows preemption and recompute; a constraint that cannot be
compiled is refused before anything runs; equal constraints compile once.
On the default model (SmolLM2-135M-Instruct)."""

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (a dependency)")

from folio import LLM, SamplingParams
from folio.structured_outputs import StructuredOutputsParams

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", max_model_len=2048, num_kv_blocks=256)


def chat(llm, text):
    return {"prompt_token_ids": llm.get_tokenizer().encode_chat(
        [{"role": "user", "content": text}])}


def check_person(text):
    value = json.loads(text)
    assert list(value) == ["name", "age", "tags"]          # the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert 1 <= len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b", "c"}


def test_every_sample_matches_the_schema(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=80,
                            structured_outputs={"json": PERSON})
    out = llm.generate(chat(llm, "Describe a person as JSON."), params, use_tqdm=False)[0]
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        check_person(o.text)


@pytest.mark.parametrize("kind, value, check", [
    ("regex", r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ("choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
])
def test_regex_and_choice_hold_on_every_sample(llm, kind, value, check):
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=30,
                            structured_outputs={kind: value})
    out = llm.generate(chat(llm, "What is your favourite colour?"), params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for o in out.outputs:
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_json_object_parses(llm):
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json_object": True})
    ask = 'Reply with a JSON object with the keys "city" and "country" for Paris.'
    o = llm.generate(chat(llm, ask), params, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict), o.text


def test_a_cut_off_is_length_not_a_claim_of_validity(llm):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": PERSON})
    o = llm.generate(chat(llm, "A person."), params, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3


def test_unconstrained_rows_of_a_mixed_batch_get_their_own_tokens(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [chat(llm, "Tell me about the sea."), chat(llm, "Count to ten.")]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=0, max_tokens=24,
                                 structured_outputs={"regex": "[A-Z]+"})
    mixed = llm.generate([prompts[0], chat(llm, "Shout."), prompts[1]],
                         [plain, constrained, plain], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert re.fullmatch("[A-Z]+", mixed[1].outputs[0].text)


def test_the_mask_allows_exactly_what_the_matcher_accepts(llm):
    """apply_grammars against the matcher itself, at each step of a JSON text:
    the finite logits are the tokens a matcher in the same state accepts."""
    import xgrammar as xgr

    from folio.worker.grammar_state import GrammarState, apply_grammars
    spec = StructuredOutputsParams(json=PERSON)
    compiled = llm.engine.input_processor.grammars.compile(spec)
    tok = llm.get_tokenizer()
    text = tok.encode('{"name": "Al", "age": 7, "tags": ["a"]}', add_special_tokens=False)
    vocab = llm.engine.config.model.vocab_size
    state, probe = GrammarState(compiled), xgr.GrammarMatcher(compiled)
    for step in (0, 1, 3, len(text) // 2, len(text)):
        logits = torch.zeros(2, vocab)
        apply_grammars(logits, [None, state], [None, text[:step]])
        allowed = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
        probe.reset()
        for t in text[:step]:
            assert probe.accept_token(t)
        accepted = set()
        for t in range(vocab):
            if probe.accept_token(t):
                accepted.add(t)
                probe.rollback(1)
        assert allowed == accepted and allowed, step
        assert torch.isfinite(logits[0]).all()         # the unconstrained row: untouched


def test_the_matcher_follows_preemption_and_recompute():
    tight = LLM(None, dtype="float32", max_model_len=2048, num_kv_blocks=14, block_size=16,
                max_num_seqs=4)
    tok = tight.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": f"Person {i}."}])}
               for i in range(4)]
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=100,
                            structured_outputs={"json": PERSON})
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason == "stop":
            check_person(o.text)
        else:
            assert o.finish_reason == "length"
    assert sum(out.outputs[0].finish_reason == "stop" for out in outs) >= 2
    assert tight.engine.scheduler.kv.num_free_blocks == 14


@pytest.mark.parametrize("spec, error", [
    ({"json": {"type": "objec"}}, "json cannot be compiled: .*objec"),
    ({"regex": "[a-"}, "regex cannot be compiled"),
    ({"grammar": "root ::= ("}, "grammar cannot be compiled"),
])
def test_a_constraint_that_cannot_be_compiled_is_refused(llm, spec, error):
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(ValueError, match=error):
        llm.generate(chat(llm, "Hi."), params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, error", [
    ({}, "exactly one of json, regex, choice, grammar and json_object; got none"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"json_object": False}, "got none"),
])
def test_bad_params_are_refused_when_made(fields, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(structured_outputs=fields)


def test_equal_constraints_compile_once(llm):
    grammars = llm.engine.input_processor.grammars
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    before = grammars.misses
    params = [SamplingParams(max_tokens=12, structured_outputs={"json": json.dumps(schema)}),
              SamplingParams(max_tokens=12, structured_outputs={"json": schema})]
    outs = llm.generate([chat(llm, "x?"), chat(llm, "x!")], params, use_tqdm=False)
    assert grammars.misses == before + 1
    assert all(isinstance(json.loads(o.outputs[0].text)["x"], int) for o in outs
               if o.outputs[0].finish_reason == "stop")


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "#/if, #/then"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "#/properties/x/not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "#/uniqueItems"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "#/allOf"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "#/dependentRequired"),
])
def test_keywords_the_grammar_would_not_hold_to_are_refused(llm, schema, where):
    with pytest.raises(ValueError, match=f"cannot enforce: {re.escape(where)}"):
        llm.generate(chat(llm, "Hi."), SamplingParams(max_tokens=4,
                                                      structured_outputs={"json": schema}))


def test_a_property_named_like_a_keyword_is_only_a_name(llm):
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": [1]}},
              "required": ["not", "if"]}
    o = llm.generate(chat(llm, "Numbers."), SamplingParams(
        temperature=0, max_tokens=30, structured_outputs={"json": schema}))[0].outputs[0]
    assert o.finish_reason == "stop" and json.loads(o.text)["if"] == 1


@pytest.mark.parametrize("keyword", ["if/then", "not", "dependentRequired", "uniqueItems",
                                     "allOf"])
def test_xgrammar_still_does_not_enforce_what_is_refused(llm, keyword):
    """The probe behind the refusal: the compiled grammar lets a violating text
    through. When a newer xgrammar enforces one, this fails: drop it from the
    refused list then."""
    import xgrammar as xgr
    schema, bad = {
        "if/then": ({"type": "object", "properties": {"a": {"type": "integer"},
                                                      "b": {"type": "integer"}},
                     "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
                    '{"a": 1}'),
        "not": ({"not": {"type": "string"}}, '"x"'),
        "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"},
                                                                "b": {"type": "integer"}},
                               "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
        "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                        "[1, 1]"),
        "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    }[keyword]
    compiler = llm.engine.input_processor.grammars._get_compiler()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema),
                                                              any_whitespace=False))
    eos = llm.get_tokenizer().eos_token_ids[0]
    assert matcher.accept_string(bad) and matcher.accept_token(eos)


@pytest.mark.parametrize("grammar", [
    'root ::= "The answer is " ("yes" | "no") "."',                     # EBNF (GBNF style)
    'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"',         # Lark
])
def test_a_grammar_holds(llm, grammar):
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=20,
                            structured_outputs={"grammar": grammar})
    out = llm.generate(chat(llm, "Is the sky blue?"), params, use_tqdm=False)[0]
    assert {o.text for o in out.outputs} <= {"The answer is yes.", "The answer is no."}


def test_stop_strings_and_prefix_hits_under_a_constraint(llm):
    prompt = chat(llm, "Count from one to ten in words, separated by commas.")
    params = SamplingParams(temperature=0, max_tokens=60, stop=[", four"],
                            structured_outputs={"regex": "[a-z]+(, [a-z]+)*"})
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    o = first.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == ", four" and ", four" not in o.text
    assert re.fullmatch("[a-z]+(, [a-z]+)*", o.text)
    assert again.num_cached_tokens > 0 and again.outputs[0].text == o.text
