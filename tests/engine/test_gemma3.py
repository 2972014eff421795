"""Gemma 3 (text) against transformers on tiny random checkpoints saved by
transformers: a 16-token window, two local layers then a global one, prompts
longer than the window; on the torch, the native CPU and the Triton attention backends,
alone, batched under preemption, after a prefix hit, and prompt logprobs."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model.loader import load_model_config
from folio.model.native_decoder import NativeDecoder
from tests.parity import (assert_batched_parity_under_preemption, assert_greedy_parity,
                          assert_tp2_greedy_parity,
                          assert_window_matters, assert_windowed_greedy_parity, prompt_logprobs,
                          reference_greedy, reference_prompt_logprobs, windowed_prompts)
from tests.utils import load_reference_model, make_tiny_model

NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# TRITON on a CPU: triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
BACKENDS = ["TORCH_SDPA", "CPU_NATIVE",
            pytest.param("TRITON", marks=pytest.mark.skipif(
                importlib.util.find_spec("triton") is None, reason="triton is not installed"))]
WINDOW = 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3", dialect="v5")
    return path, load_reference_model(path)


def _prompts(n: int, seed: int) -> list[list[int]]:
    return windowed_prompts(n, seed, WINDOW)


def _layers(llm):
    return llm.engine.executor.runner.model.model.layers


@pytest.mark.parametrize("dialect", ["v5", "classic"])
def test_the_config_is_read_in_both_dialects(tmp_path, dialect):
    path = make_tiny_model(tmp_path, arch="gemma3", dialect=dialect,
                           rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = load_model_config(path)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.query_pre_attn_scalar == 24 and cfg.head_dim == 16
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.final_logit_softcapping is None
    # the global layers see everything: the length is not capped at the window
    assert cfg.max_position_embeddings == 512


@pytest.mark.parametrize("field,value,message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true is not supported"),
    ("sliding_window", None, "sliding_window must be a positive integer"),
])
def test_what_is_not_run_is_refused(gemma3, tmp_path, field, value, message):
    src, _ = gemma3
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg[field] = value
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model_config(str(folder))


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_layer_knows_its_window_and_weights_load(gemma3, backend):
    path, ref = gemma3
    llm = LLM(path, dtype="float32", num_kv_blocks=32, attention_backend=backend)
    layers = _layers(llm)
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, WINDOW, None]
    assert all(layer.self_attn.attn.scale == 24 ** -0.5 for layer in layers)
    assert llm.engine.executor.runner.model.model.native_decoder is None
    assert NativeDecoder.build(list(layers)) is None
    for ours, theirs in zip(layers, ref.model.layers):
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            assert torch.equal(getattr(ours, name).weight, getattr(theirs, name).weight)
        assert torch.equal(ours.self_attn.k_norm.weight, theirs.self_attn.k_norm.weight)


# (interpreted Triton takes ~10 s a run: it runs the batched and the logprob tests)
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_greedy_tokens_alone_and_after_a_prefix_hit(gemma3, backend):
    path, ref_model = gemma3
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8, attention_backend=backend)
    assert_windowed_greedy_parity(llm, ref_model, _prompts(3, 1), NEW, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_batched_under_preemption(gemma3, backend):
    path, ref_model = gemma3
    # interpreted Triton: three of the five prompts, in a cache that still preempts
    prompts, blocks = (3, 24) if backend == "TRITON" else (5, 40)
    assert_batched_parity_under_preemption(path, ref_model, _prompts(prompts, 2), NEW, blocks,
                                           backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_match_and_the_window_matters(gemma3, backend):
    """Scored in chunks of 16 tokens over blocks of 4 (resumed chunks); the
    same model with its local layers made global parts from transformers."""
    path, ref_model = gemma3
    ids = _prompts(1, 9)[0] + _prompts(1, 10)[0]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16, attention_backend=backend)
    assert_window_matters(llm, ref_model, ids, WINDOW)


def test_final_logit_softcapping(tmp_path):
    path = make_tiny_model(tmp_path, arch="gemma3", dialect="v5", final_logit_softcapping=2.0)
    ref_model = load_reference_model(path)
    assert ref_model.config.final_logit_softcapping == 2.0
    ids = _prompts(1, 4)[0]
    llm = LLM(path, dtype="float32", num_kv_blocks=32, block_size=8)
    got, expected = prompt_logprobs(llm, ids), reference_prompt_logprobs(ref_model, ids)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # the cap bounds every logit: its logprobs sit above -(2 * 2 + log(vocab))
    assert got.min() > -(4.0 + torch.log(torch.tensor(384.0)))


def test_a_backend_without_windows_refuses_the_model(gemma3):
    from folio.model.registry import build_model
    from tests.model.test_sliding_window_attention import NoWindows
    cfg = load_model_config(gemma3[0])
    with pytest.raises(ValueError, match="NO_WINDOWS does not run sliding-window layers .*"
                                         "--attention-backend: TRITON, CPU_NATIVE, TORCH_SDPA"):
        build_model(cfg, torch.float32, "cpu", attn_backend=NoWindows)
    # all-global layers (a window nobody uses) build on it
    build_model(dataclasses.replace(cfg, layer_types=("full_attention",) * 3,
                                    sliding_window=None),
                torch.float32, "cpu", attn_backend=NoWindows)


def test_tensor_parallel_2_gives_transformers_tokens(gemma3):
    """Heads and the MLP split over 2 ranks; each rank's local layers keep the window."""
    path, ref_model = gemma3
    assert_tp2_greedy_parity(path, ref_model, _prompts(3, 5), NEW)


def test_the_rotary_tables_hold_max_model_len_positions(gemma3):
    """Both tables (global and local bases) as long as the served context,
    not the model's 512 positions; the tokens at the longest prompts allowed
    are transformers'."""
    path, ref_model = gemma3
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=100)
    model = llm.engine.executor.runner.model.model
    assert model.rotary.cos.shape[0] == model.rotary_local.sin.shape[0] == 100
    ids = _prompts(1, 5)[0][:84]
    ids += [9] * (84 - len(ids))                    # the last token lands at position 99
    ref, gaps = reference_greedy(ref_model, ids, NEW, ())
    out = llm.generate({"prompt_token_ids": ids}, PARAMS)[0].outputs[0]
    assert_greedy_parity(out.token_ids, ref, gaps, label="to max_model_len")
