"""Greedy parity with transformers on the default model (fp32, same GGUF weights):
one request at a time, and all together in one continuous batch with staggered
arrivals."""

import pytest

from folio import SamplingParams
from tests.parity import assert_greedy_parity, reference_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about paged memory.",
    "List three prime numbers.",
    "Explain in one sentence what a GPU is.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a friendly robot.",
    "Why is the sky blue? Answer briefly.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def chats(default_llm):
    tok = default_llm.get_tokenizer()
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(chats, default_llm, default_reference):
    eos = default_llm.get_tokenizer().eos_token_ids
    return [reference_greedy(default_reference, ids, MAX_TOKENS, eos) for ids in chats]


def test_one_request_at_a_time(default_llm, chats, references):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    compared = 0
    for ids, (ref, gaps) in zip(chats, references):
        out = default_llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
        compared += assert_greedy_parity(out.token_ids, ref, gaps, label=str(ids[-12:]))
    assert compared >= len(chats) * 8


def test_continuous_batch_with_staggered_arrivals(default_llm, chats, references):
    engine = default_llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    results, pending = {}, list(enumerate(chats))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:          # a new arrival every third step
            i, ids = pending.pop(0)
            engine.add_request(f"stagger-{i}", {"prompt_token_ids": ids}, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    batched_steps = steps
    for i, (ref, gaps) in enumerate(references):
        assert_greedy_parity(results[f"stagger-{i}"], ref, gaps, label=QUESTIONS[i])
    # continuous batching actually overlapped them: far fewer steps than run alone
    assert batched_steps < sum(len(r) for r, _ in references)
