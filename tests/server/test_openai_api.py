"""The official `openai` client against a real server on a tiny model."""

import asyncio

import openai
import pytest
import torch

from tests.server.conftest import http
from tests.utils import load_reference_model

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_and_stream_agree(client):
    full = client.completions.create(model="tiny", prompt="Hello world", **GREEDY)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt="Hello world", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == ["length"]                       # exactly one chunk carries it
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_n_and_multiple_prompts_and_token_ids(client, server):
    out = client.completions.create(model="tiny", prompt=[[1, 40, 41, 42], [1, 50, 51]], n=2,
                                    temperature=1.0, seed=5, max_tokens=4,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == 7                     # once per prompt, not per n
    _, _, tok = http("POST", server.url + "/tokenize", {"prompt": "Hello"})
    two = client.completions.create(model="tiny", prompt=["Hello", "Hello"], max_tokens=2)
    assert two.usage.prompt_tokens == 2 * tok["count"] and len(two.choices) == 2


def test_stop_string_is_not_emitted(client):
    full = client.completions.create(model="tiny", prompt="Hello world", **GREEDY).choices[0].text
    stop = full[3:5]
    cut = full.find(stop)
    for stream in (False, True):
        resp = client.completions.create(model="tiny", prompt="Hello world", stop=[stop],
                                         stream=stream, **GREEDY)
        text = ("".join(c.choices[0].text for c in resp if c.choices) if stream
                else resp.choices[0].text)
        assert text == full[:cut]


def test_echo_logprobs_match_transformers(client, tiny_model):
    ids = [1, 30, 31, 32, 33, 34, 35]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True,
                                    logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    ref = load_reference_model(tiny_model)
    with torch.inference_mode():
        logits = ref(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(expected[p - 1, ids[p]].item(), abs=1e-4)
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs)


def test_chat_stream_and_logprobs(client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    full = client.chat.completions.create(model="tiny", messages=msgs, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert len(choice.logprobs.content) == 12
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    two = client.chat.completions.create(model="tiny", messages=msgs, n=2, max_tokens=3)
    assert len(two.choices) == 2


def test_async_client(aclient):
    async def go():
        outs = await asyncio.gather(*[aclient.completions.create(
            model="tiny", prompt=f"Hello {i}", **GREEDY) for i in range(4)])
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, **GREEDY)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return outs, text
    outs, text = asyncio.run(go())
    assert all(o.usage.completion_tokens == 12 for o in outs) and text


def test_sixty_four_concurrent_streams(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def one(i):
        stream = await client.completions.create(model="tiny", prompt=f"Client {i}",
                                                 max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        last = None
        async for chunk in stream:
            last = chunk
        return last.usage.completion_tokens

    async def all64():
        return await asyncio.gather(*[one(i) for i in range(64)])
    assert asyncio.run(all64()) == [5] * 64


def test_prefix_cache_shows_in_usage_and_metrics(client, server):
    from tests.server.test_lifecycle import metrics
    long_prompt = [1] + [(i * 3) % 300 + 5 for i in range(100)]
    first = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=long_prompt + [7, 8], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96     # 12 full blocks of 8
    m = metrics(server)
    assert m["folio:prefix_cache_hits_total"] >= 96
    assert m["folio:prefix_cache_queries_total"] >= 101 + 103


def test_chat_n2_stop_and_usage_streamed(client):
    msgs = [{"role": "user", "content": "Tell me something"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, **GREEDY)
    text = full.choices[0].message.content
    stop = text[4:6]
    cut = text.find(stop)
    plain = client.chat.completions.create(model="tiny", messages=msgs, stop=[stop], **GREEDY)
    assert plain.choices[0].message.content == text[:cut]
    assert plain.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, stop=[stop], n=2, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == text[:cut]
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_beam_search_over_http_matches_transformers(client, tiny_model):
    from tests.engine.test_beam_search import reference_beams
    prompt = [1, 30, 31, 32, 33]
    out = client.completions.create(model="tiny", prompt=prompt, n=2, best_of=4, max_tokens=12,
                                    extra_body={"use_beam_search": True})
    expected, _ = reference_beams(load_reference_model(tiny_model), prompt, 4, 12, False, 1.0,
                                  {2, 4})
    from folio.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_folder(tiny_model)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [tok.decode([t for t in e if t not in (2, 4)]) for e in expected[:2]]
    assert out.usage.completion_tokens == sum(len(e) for e in expected)   # all 4 searched
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model="tiny", prompt=prompt, stream=True, max_tokens=4,
                                  extra_body={"use_beam_search": True})
