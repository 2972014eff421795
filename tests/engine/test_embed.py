"""Embedding requests (issue 55): `LLM.embed` pools a prompt's final hidden
states into a vector, scheduled as any prompt (chunked under the token
budget, beside generation, preempted and recomputed), nothing generated.

References: transformers' `AutoModel` (the decoder without its LM head) on the
same tiny random checkpoints, its `last_hidden_state` pooled by this test's
own code: the last position's, the mean of all, the first's; then truncated
and L2-normalized as asked."""

import json

import pytest
import torch

from folio import LLM, PoolingParams, SamplingParams
from tests.utils import make_tiny_model

PROMPTS = [list(range(5, 5 + n)) for n in (3, 40, 9, 1, 27)]


def _hf(folder):
    from transformers import AutoModel
    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def _reference(hf, ids, pooling="last", normalize=True, dimensions=None):
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0].double()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    v = v[:dimensions] if dimensions else v
    return v / v.norm() if normalize else v


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    return folder, _hf(folder)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_each_pooling_is_transformers_hidden_states_pooled(model, pooling, normalize):
    """Prompts of 1 to 40 tokens under a 16-token budget: the long ones in
    chunks, pooled across them."""
    folder, hf = model
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    free = llm.engine.scheduler.kv.pool.num_free_blocks
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS],
                     PoolingParams(pooling=pooling, normalize=normalize), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = _reference(hf, ids, pooling, normalize)
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        assert out.finished and out.error is None and out.prompt_token_ids == ids
        assert got.shape == (64,) and out.outputs.hidden_size == 64
        assert (got - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
    assert llm.engine.scheduler.kv.pool.num_free_blocks == free


def test_the_default_is_the_last_token_normalized_and_dimensions_truncate(model):
    folder, hf = model
    llm = LLM(folder, dtype="float32", num_kv_blocks=64)
    default, short = (llm.embed([{"prompt_token_ids": PROMPTS[1]}], p, use_tqdm=False)[0]
                      for p in (None, PoolingParams(dimensions=16)))
    assert torch.allclose(torch.tensor(default.outputs.embedding, dtype=torch.float64),
                          _reference(hf, PROMPTS[1]), atol=1e-6)
    assert len(short.outputs.embedding) == 16
    assert torch.allclose(torch.tensor(short.outputs.embedding, dtype=torch.float64),
                          _reference(hf, PROMPTS[1], dimensions=16), atol=1e-6)


def test_embeddings_beside_generation_change_neither(model):
    """Embedding and generation requests in the same steps: each gets what it
    gets alone, and every block comes back."""
    folder, _ = model
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gen = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    alone = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    tokens = [o.outputs[0].token_ids for o in alone.generate(gen, params, use_tqdm=False)]
    vectors = [o.outputs.embedding for o in alone.embed(
        [{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling="mean"),
        use_tqdm=False)]
    engine = LLM(folder, dtype="float32", num_kv_blocks=64,
                 max_num_batched_tokens=24).engine
    free = engine.scheduler.kv.pool.num_free_blocks
    for i, p in enumerate(gen):
        engine.add_request(f"g{i}", p, params)
    for i, p in enumerate(PROMPTS):
        engine.add_pooling_request(f"e{i}", None, p, PoolingParams(pooling="mean"))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(3)] == tokens
    for i, v in enumerate(vectors):
        assert torch.allclose(torch.tensor(done[f"e{i}"].outputs.embedding), torch.tensor(v),
                              atol=1e-6)
    assert engine.scheduler.kv.pool.num_free_blocks == free


def test_preempted_embeddings_are_recomputed_from_the_start(model):
    """A cache too small for every prompt at once: requests are preempted
    and recomputed; the mean restarts with the prompt, the vectors are those
    of a roomy cache."""
    folder, _ = model
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 60))} for i in range(6)]
    pooling = PoolingParams(pooling="mean")
    roomy = LLM(folder, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)
    expect = [o.outputs.embedding for o in roomy.embed(prompts, pooling, use_tqdm=False)]
    tight = LLM(folder, dtype="float32", num_kv_blocks=12, block_size=16,
                max_num_batched_tokens=32)
    # generation beside them keeps the cache full so that they are preempted
    engine = tight.engine
    for i in range(3):
        engine.add_request(f"g{i}", {"prompt_token_ids": list(range(3, 40))},
                           SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for i, p in enumerate(prompts):
        engine.add_pooling_request(f"e{i}", None, p["prompt_token_ids"], pooling)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.scheduler.num_preemptions > 0
    for i, v in enumerate(expect):
        assert torch.allclose(torch.tensor(done[f"e{i}"].outputs.embedding), torch.tensor(v),
                              atol=1e-6)


def test_last_token_pooling_takes_cached_blocks(model):
    """The last position is always computed, so a repeated prompt's earlier
    blocks come from the prefix cache (mean and cls compute every position)."""
    folder, _ = model
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, block_size=16)
    ids = list(range(3, 60))
    first, again = (llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    assert torch.allclose(torch.tensor(first.outputs.embedding),
                          torch.tensor(again.outputs.embedding), atol=1e-6)
    mean = PoolingParams(pooling="mean")
    assert all(llm.embed([{"prompt_token_ids": ids}], mean, use_tqdm=False)[0]
               .num_cached_tokens == 0 for _ in range(2))


def test_the_models_sentence_transformers_pooling_is_its_default(tmp_path):
    """modules.json naming a Pooling module (mean) and no Normalize: the
    default pools the mean, not normalized."""
    folder = make_tiny_model(tmp_path / "m")
    (tmp_path / "m" / "1_Pooling").mkdir()
    (tmp_path / "m" / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    (tmp_path / "m" / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    llm = LLM(folder, dtype="float32", num_kv_blocks=64)
    got = llm.embed([{"prompt_token_ids": PROMPTS[1]}], use_tqdm=False)[0].outputs.embedding
    assert torch.allclose(torch.tensor(got, dtype=torch.float64),
                          _reference(_hf(folder), PROMPTS[1], "mean", normalize=False),
                          atol=1e-5)


def test_the_engine_in_its_own_process_embeds_the_same(model):
    folder, _ = model
    args = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    inproc = LLM(folder, **args).embed(prompts, PoolingParams(pooling="mean"), use_tqdm=False)
    core = LLM(folder, engine_process=True, **args)
    try:
        other = core.embed(prompts, PoolingParams(pooling="mean"), use_tqdm=False)
    finally:
        core.shutdown()
    assert [o.outputs.embedding for o in other] == [o.outputs.embedding for o in inproc]


@pytest.mark.parametrize("prompt,params,message", [
    ([], PoolingParams(), "the input is empty"),
    ([3 + i % 300 for i in range(513)], PoolingParams(), "513 tokens, more than max_model_len"),
    ([1, 2], PoolingParams(dimensions=65), "dimensions=65 is more than the model's 64"),
    ([1, 500], PoolingParams(), "token id 500 is outside the vocabulary"),
])
def test_bad_inputs_are_refused_before_any_is_added(model, prompt, params, message):
    folder, _ = model
    llm = LLM(folder, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        llm.embed([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": prompt}], params,
                  use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # a prompt of exactly max_model_len is an input, not an error: nothing follows it
    assert len(llm.embed([{"prompt_token_ids": [3 + i % 300 for i in range(512)]}],
                         use_tqdm=False)[0].outputs.embedding) == 64


@pytest.mark.parametrize("kwargs,message", [
    (dict(pooling="max"), "pooling must be one of last, mean, cls"),
    (dict(normalize="yes"), "normalize must be true or false"),
    (dict(dimensions=0), "dimensions must be a positive integer"),
])
def test_impossible_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**kwargs)


def test_an_aborted_embedding_frees_its_blocks_and_says_so(model):
    """Aborted mid-prompt (its first chunk computed): its blocks come back,
    its output says "abort" with no vector, and the others finish."""
    folder, _ = model
    engine = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16).engine
    free = engine.scheduler.kv.pool.num_free_blocks
    engine.add_pooling_request("long", None, PROMPTS[1], PoolingParams(pooling="mean"))
    engine.add_pooling_request("short", None, PROMPTS[0], PoolingParams())
    engine.step()                                   # the long one's first chunk
    [aborted] = engine.abort_request(["long"])
    assert aborted.finished and aborted.outputs.embedding == []
    assert aborted.outputs.finish_reason == "abort"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done["short"].outputs.embedding) == 64 and "long" not in done
    assert engine.scheduler.kv.pool.num_free_blocks == free


def test_a_decoder_saved_as_its_base_model_serves_embeddings(tmp_path):
    """Qwen3-Embedding's layout: a Qwen3ForCausalLM config, its tensors the base
    model's (no "model." prefix, no lm_head), sentence-transformers files for
    last-token pooling and Normalize. Folio loads it for embeddings (--task
    auto: embed), gives transformers' last hidden state of the last token,
    normalized, and refuses to generate from it."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "emb"
    make_tiny_model(folder, arch="qwen3")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()
               if not k.startswith("lm_head.")}, str(path), metadata={"format": "pt"})
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.config.model.headless and llm.engine.config.model.task == "embed"
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    hf = _hf(str(folder))
    for ids, out in zip(PROMPTS, outs):
        assert torch.allclose(torch.tensor(out.outputs.embedding, dtype=torch.float64),
                              _reference(hf, ids, "last", True), atol=1e-6)
    with pytest.raises(ValueError, match="a base model without an LM head: it computes"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="saved as a base model, without an LM head"):
        LLM(str(folder), task="generate")
