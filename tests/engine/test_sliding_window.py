"""Mistral's sliding window, every layer's, against transformers on a tiny
random checkpoint it saved (window 16, prompts longer than it): the context
is not capped at the window, each layer attends to its last 16 keys on the
torch, the native CPU and the Triton backends, alone, after a prefix hit,
batched under preemption, with tensor parallelism 2, and prompt logprobs;
blocks behind every layer's window go back to the pool, so a sequence far
longer than the cache runs in it, and every block comes back at the end."""

import importlib.util
import json
import shutil

import pytest

from folio import LLM, SamplingParams
from folio.model.loader import load_model_config
from tests.parity import (assert_batched_parity_under_preemption, assert_greedy_parity,
                          assert_tp2_greedy_parity,
                          assert_window_matters, assert_windowed_greedy_parity, reference_greedy,
                          windowed_prompts)
from tests.utils import load_reference_model, make_tiny_model

NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
WINDOW = 16
BACKENDS = ["TORCH_SDPA", "CPU_NATIVE",
            pytest.param("TRITON", marks=pytest.mark.skipif(
                importlib.util.find_spec("triton") is None, reason="triton is not installed"))]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("mistral"), arch="mistral", dialect="v5",
                           sliding_window=WINDOW)
    return path, load_reference_model(path)


def _prompts(n: int, seed: int) -> list[list[int]]:
    return windowed_prompts(n, seed, WINDOW)


def _layers(llm):
    return llm.engine.executor.runner.model.model.layers


def test_every_layer_has_the_window_and_the_context_is_not_capped(mistral):
    path, _ = mistral
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.sliding_window, cfg.max_position_embeddings) == (
        "MistralForCausalLM", WINDOW, 512)
    llm = LLM(path, dtype="float32", num_kv_blocks=32)
    assert [layer.self_attn.attn.sliding_window for layer in _layers(llm)] == [WINDOW] * 2
    assert llm.engine.scheduler.kv.window == WINDOW
    # served no longer than the window, nothing is hidden: no window anywhere
    short = LLM(path, dtype="float32", num_kv_blocks=32, max_model_len=WINDOW)
    assert [layer.self_attn.attn.sliding_window for layer in _layers(short)] == [None] * 2
    assert short.engine.scheduler.kv.window is None


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_greedy_tokens_alone_and_after_a_prefix_hit(mistral, backend):
    path, ref_model = mistral
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8, attention_backend=backend)
    assert_windowed_greedy_parity(llm, ref_model, _prompts(3, 1), NEW, backend)
    assert llm.engine.scheduler.kv.num_free_blocks == 64


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_batched_under_preemption(mistral, backend):
    path, ref_model = mistral
    prompts, blocks = (3, 14) if backend == "TRITON" else (5, 16)
    assert_batched_parity_under_preemption(path, ref_model, _prompts(prompts, 2), NEW, blocks,
                                           backend)


def test_prompt_logprobs_match_and_the_window_matters(mistral):
    path, ref_model = mistral
    ids = _prompts(1, 9)[0] + _prompts(1, 10)[0]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert_window_matters(llm, ref_model, ids, WINDOW)


def test_a_sequence_longer_than_the_cache_runs_in_the_window(mistral, tmp_path):
    """8 blocks of 8 (64 tokens) hold a 40-token prompt and 200 more tokens:
    each step's blocks are taken after those behind the window went back, so
    a sequence holds at most (window - 1 + step tokens) / 8 + 1 blocks; the
    tokens are transformers'; no block leaks. Without the window, a server
    refuses such a cache at start."""
    path, ref_model = mistral
    ids = _prompts(1, 4)[0][:40]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=8, max_num_batched_tokens=16)
    kv = llm.engine.scheduler.kv
    held, allocate = [], kv.allocate_slots

    def watched(seq_ids, num_computed, num_tokens):
        grants = allocate(seq_ids, num_computed, num_tokens)
        held.append(max(kv.num_blocks_of(s) for s in seq_ids))
        return grants

    kv.allocate_slots = watched
    out = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    ref, gaps = reference_greedy(ref_model, ids, 200, ())
    assert_greedy_parity(out.token_ids, ref, gaps, label="240 tokens in 64 slots")
    assert 3 <= max(held) <= kv.most_blocks(240, 16) == 5
    assert kv.num_free_blocks == 8 and not kv.tables
    # the same model without a window: one sequence of max_model_len (512)
    # needs all its 64 blocks, which 8 cannot hold
    unwindowed = tmp_path / "unwindowed"
    shutil.copytree(path, unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    config["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(config))
    llm.engine.check_kv_cache()             # what a server checks at start
    small = LLM(str(unwindowed), dtype="float32", num_kv_blocks=8, block_size=8,
                max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="one sequence of max_model_len=512 tokens needs 64 "
                                         "blocks"):
        small.engine.check_kv_cache()


def test_parallel_samples_share_the_window_blocks(mistral):
    """n = 3 forks of one prompt: the blocks they share before the window
    passes them go back once every fork has moved on; the samples are
    reproducible by seed and every block comes back."""
    path, _ = mistral
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60, ignore_eos=True)
    ids = _prompts(1, 6)[0]
    first = llm.generate({"prompt_token_ids": ids}, params)[0]
    again = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert llm.engine.scheduler.kv.num_free_blocks == 24


def test_tensor_parallel_2_gives_transformers_tokens(mistral):
    path, ref_model = mistral
    assert_tp2_greedy_parity(path, ref_model, _prompts(3, 5), NEW)


def test_ngram_proposals_past_the_window_keep_transformers_tokens(mistral):
    """Proposals (ngram, 6 a step, blocks of 4; a token seen before suffices,
    so this random model gets some) in a tight cache: a step's verified token
    still reads behind its proposals' window, and the tokens stay
    transformers'."""
    path, ref_model = mistral
    base = windowed_prompts(1, 12, WINDOW)[0][:12]
    batch = [base * 4, (base[3:] + base[:3]) * 3]                 # repeats: proposals
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=32,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6,
                                  "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outs):
        ref, gaps = reference_greedy(ref_model, ids, 40, ())
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label="ngram")
    assert llm.engine.scheduler.spec_counts.draft_tokens > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 24
