"""The offline API on a tiny model: shapes of the results, bad input, sampling."""

import pytest

from folio import LLM, RequestOutput, SamplingParams
from folio.config import parse_size
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128)
    return LLM(path, dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64)


def test_results_in_input_order_with_vllm_shape(llm):
    prompts = ["Hello world", {"prompt_token_ids": [1, 50, 60, 70]}, {"prompt": "The quick"}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert outs[0].prompt == "Hello world" and outs[1].prompt is None
    assert outs[1].prompt_token_ids == [1, 50, 60, 70]          # token ids used verbatim
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("Hello world")
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and len(c.token_ids) == 5
        assert c.finish_reason == "length" and c.cumulative_logprob < 0
        assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_eos_token_is_kept_in_ids_but_not_in_text(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    first = out.token_ids[0]
    # Make the first greedy token an EOS through stop_token_ids: finish 'stop', no text.
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=40,
                                               stop_token_ids=[first]))[0].outputs[0]
    assert out.token_ids == [first] and out.text == ""
    assert out.finish_reason == "stop" and out.stop_reason == first
    assert tok.eos_token_ids    # the tiny model has EOS ids from its configs


def test_max_model_len_ends_a_request(llm):
    out = llm.generate({"prompt_token_ids": [5] * 60},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompt,params,message", [
    ({"prompt_token_ids": [5] * 64}, {}, "64 tokens but max_model_len is 64"),
    ({"prompt_token_ids": [5] * 200}, {}, "200 tokens"),
    ("", {}, "empty"),
    ({"prompt_token_ids": []}, {}, "empty"),
    ({"prompt_token_ids": [5, 384]}, {}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, {}, "outside the vocabulary"),
    ({"prompt_token_ids": ["a"]}, {}, "list of integers"),
    (42, {}, "a prompt must be"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"temperature": -0.5}, "temperature"),
    ("hi", {"top_p": 0.0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"top_k": -3}, "top_k"),
    ("hi", {"logprobs": 21}, "more than max_logprobs"),
    ("hi", {"prompt_logprobs": -1}, "prompt_logprobs"),
    # Values that used to pass here and fail inside the engine step:
    ("hi", {"seed": 2 ** 70}, "seed must be"),
    ("hi", {"seed": 2 ** 63 - 1, "n": 2}, "seed must be"),
    ("hi", {"top_k": 2 ** 70}, "top_k"),
    ("hi", {"stop_token_ids": [2 ** 63]}, "stop_token_ids"),
    ("hi", {"temperature": float("nan")}, "temperature must be a finite"),
    ("hi", {"repetition_penalty": float("inf")}, "repetition_penalty must be a finite"),
    ("hi", {"top_p": float("nan")}, "top_p"),
    ("hi", {"logit_bias": {3: float("nan")}}, "logit_bias"),
])
def test_bad_input_is_a_clear_error_and_harms_nothing(llm, prompt, params, message):
    good = {"prompt_token_ids": [1, 20, 30]}
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], SamplingParams(**params) if params else None)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
    out = llm.generate(good, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_unknown_model_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=123, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate("Hello world", params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["The quick", "Hello world", "Paged"], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(["Hello world"] * 2, others)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top1 = llm.generate("Hello", SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=8,
                                                ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_chat_renders_the_template_once(llm):
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert out.prompt.startswith("<|im_start|>user\nhi<|im_end|>")
    assert out.prompt_token_ids.count(1) <= 1      # never a double BOS


@pytest.mark.parametrize("text,size", [("4GiB", 4 * 1024**3), ("512MiB", 512 * 1024**2),
                                       ("2GB", 2 * 10**9), ("1e6", 10**6), (1024, 1024)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["4 parsecs", "-1", "0", "GiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_kv_cache_sized_from_memory_and_reported(tmp_path, caplog):
    import logging
    path = make_tiny_model(tmp_path / "m")
    caplog.set_level(logging.INFO, logger="folio")
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes="1MiB", block_size=16)
    # 2 (k, v) x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB a block
    assert llm.engine.num_blocks == 128
    assert "KV cache: 128 blocks of 16 tokens" in caplog.text
    assert llm.engine.executor.runner.kv_caches[0].shape == (2, 128, 16, 2, 16)


def test_a_request_too_big_for_the_cache_leaves_the_batch_untouched(llm):
    small = LLM(llm.engine.config.model.path, dtype="float32", num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="whole cache has 4"):
        small.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [5] * 20}],
                       SamplingParams(max_tokens=1))
    assert not small.engine.has_unfinished_requests()
    out = small.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) >= 1


def test_the_step_rate_counts_busy_spells_not_the_idle_time_between(llm):
    """num_steps and busy_seconds (StepStats, /metrics): a spell ends with its
    last step, an abort or a stop string; the time after it is not counted."""
    import time
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    steps, busy = engine.num_steps, engine.busy_seconds
    t0 = time.perf_counter()
    llm.generate(["Hello"], params, use_tqdm=False)
    first = time.perf_counter() - t0
    assert engine.num_steps - steps == 8                 # the prompt's step and 7 more
    assert 0 < engine.busy_seconds - busy <= first
    time.sleep(0.25)
    busy = engine.busy_seconds
    engine.add_request("a", "Hello", SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request(["a"])                          # ends the spell
    time.sleep(0.25)
    engine.add_request("s", "Hello", SamplingParams(max_tokens=50))
    engine.step()
    engine.stop_sequences([("s", 0)])                    # as a stop string would
    time.sleep(0.25)
    t0 = time.perf_counter()
    llm.generate(["Hello"], params, use_tqdm=False)
    last = time.perf_counter() - t0
    assert engine.busy_seconds - busy < last + 0.1       # neither pause is in it
    assert not engine.has_unfinished_requests()
