"""Phi-3 beyond test_parity_tiny.py's greedy cases (and test_qwen3.py's prefix
hit, tensor parallelism 2 and prompt logprobs, which run it too), against
transformers on the same tiny random checkpoint (saved by transformers, q/k/v
and gate/up fused as Phi-3 stores them): the fused tensors split into exactly
transformers' rows; what it cannot run (a partial rotary, longrope) refused
by name."""

import json

import pytest
import torch

from folio import LLM
from folio.engine.config_builder import build_config
from tests.utils import load_reference_model, make_tiny_model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("phi3"), arch="phi3", dialect="v5")
    return path, load_reference_model(path)


def test_the_fused_tensors_load_as_transformers_holds_them(phi3):
    path, ref = phi3
    layer = LLM(path, dtype="float32", num_kv_blocks=16).engine.executor.runner.model \
        .model.layers[1]
    theirs = ref.model.layers[1]
    assert torch.equal(layer.self_attn.qkv_proj.weight, theirs.self_attn.qkv_proj.weight)
    assert torch.equal(layer.mlp.gate_up_proj.weight, theirs.mlp.gate_up_proj.weight)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75),
     "partial_rotary_factor=0.75 \\(a partial rotary\\) is not supported"),
    (lambda c: c["rope_parameters"].update(rope_type="longrope", short_factor=[1.0] * 8,
                                           long_factor=[2.0] * 8),
     "rope scaling type 'longrope' is not supported")])
def test_what_it_cannot_run_is_refused(phi3, tmp_path, edit, message):
    import shutil
    path, _ = phi3
    folder = tmp_path / "edited"
    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        build_config(str(folder))
        LLM(str(folder), dtype="float32", num_kv_blocks=16)
