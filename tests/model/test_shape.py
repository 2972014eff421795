"""The model describes itself (model/shape.py): for tiny random checkpoints
saved by transformers, the shape Folio's model class states has the
parameters transformers' own model holds (norms and biases aside), a
mixture of experts' active parameters are its shared weights plus k of E
experts, a sliding-window layer attends to its window only, and the
tensor-parallel split is the layers' own."""

import pytest
import torch

from folio.model.loader import load_model_config
from folio.model.shape import ModelShape, shape_of
from tests.engine.test_moe import MODELS as MOE_MODELS
from tests.utils import GEMMA3_TINY, load_reference_model, make_tiny_model

ARCHS = {"llama": dict(arch="llama"), "llama-tied": dict(arch="llama", tie_word_embeddings=True),
         "qwen2": dict(arch="qwen2"), "qwen3": dict(arch="qwen3", head_dim=32),
         "gemma3": dict(arch="gemma3"), **MOE_MODELS}


def _counted(name: str) -> bool:
    return "norm" not in name and not name.endswith(".bias")


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **ARCHS[request.param])
    return shape_of(load_model_config(path)), load_reference_model(path)


def test_the_parameters_are_transformers(model):
    shape, ref = model
    params = dict(ref.named_parameters())           # a tied head is the embedding, once
    assert shape.parameters() == sum(p.numel() for n, p in params.items() if _counted(n))
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    share = shape.experts_per_token / shape.experts if shape.experts else 0
    others = sum(p.numel() for n, p in params.items() if _counted(n) and ".experts." not in n)
    assert shape.active_parameters() == round(others + experts * share)
    assert (shape.active_parameters() < shape.parameters()) == bool(shape.moe_layers)


def test_a_moe_layer_count_follows_the_config():
    path_free = ModelShape(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, vocab=10,
                           tied=False, intermediate=16, moe_layers=2, experts=4,
                           experts_per_token=2, expert_intermediate=6)
    kinds = [(lin.kind, lin.count) for lin in path_free.linears()]
    assert kinds == [("dense", 3), ("dense", 3), ("dense", 1), ("dense", 1), ("router", 2),
                     ("expert", 8), ("expert", 8)]
    # a step's tokens read the experts some token picked: k/E for one, nearly all for many
    assert path_free.expert_share(1) == 0.5 and path_free.expert_share(64) == pytest.approx(1)


def test_sliding_window_layers_attend_to_their_window_only(tmp_path):
    shape = shape_of(load_model_config(make_tiny_model(tmp_path, arch="gemma3")))
    w, n = GEMMA3_TINY["sliding_window"], 40
    assert (shape.window, shape.windowed_layers, shape.layers) == (w, 2, 3)
    keys = sum(sum(min(p + 1, w) if kind == "sliding_attention" else p + 1
                   for kind in GEMMA3_TINY["layer_types"]) for p in range(n))
    assert shape.attended(n) == keys
    # one decoded token: its linear layers, its keys, the LM head
    assert shape.flops_per_token(n) == 2 * shape.active_linear_parameters() + \
        4 * shape.heads * shape.head_dim * (shape.attended(n + 1) - shape.attended(n)) + \
        2 * shape.vocab * shape.hidden


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_the_tensor_parallel_split_is_the_layers(name, tmp_path):
    """Each rank holds a slice of every expert, as FusedMoE splits them; a size
    that does not divide is the error the layers raise."""
    cfg = load_model_config(make_tiny_model(tmp_path, **MOE_MODELS[name]))
    shape = shape_of(cfg)
    one, two = shape.linears(1), shape.linears(2)
    for a, b in zip(one, two):
        assert b.count == a.count
        if a.kind == "router":
            assert b == a                                           # replicated
        else:
            assert a.out * a.inp == 2 * b.out * b.inp               # halved
    assert shape.active_linear_parameters(2) * 2 == pytest.approx(
        shape.active_linear_parameters(1), rel=0.02)               # the router is whole
    with pytest.raises(ValueError, match="not divisible"):
        shape.linears(3)


def test_the_kv_bytes_are_the_caches(tmp_path):
    """Bytes of keys and values a token takes: what the engine's caches hold."""
    from folio import LLM
    path = make_tiny_model(tmp_path, arch="qwen3", head_dim=32)
    llm = LLM(path, dtype="float32", num_kv_blocks=8)
    caches = llm.engine.executor.runner.kv_caches
    held = sum(t.numel() * t.element_size() for t in caches)
    tokens = 8 * llm.engine.config.cache.block_size
    assert shape_of(llm.engine.config.model).kv_bytes_per_token(dtype_bytes=4) * tokens == held
    assert torch.float32 == caches[0].dtype


def test_a_mistral_window_is_every_layers(tmp_path):
    """Mistral's sliding_window on every layer: each attends to its window
    (the FLOPs and keys of `folio plan` and the benchmarks' ceilings)."""
    shape = shape_of(load_model_config(make_tiny_model(tmp_path, arch="mistral",
                                                       sliding_window=16)))
    assert (shape.window, shape.windowed_layers, shape.layers) == (16, 2, 2)
    assert shape.attended(40) == 2 * sum(min(p + 1, 16) for p in range(40))
