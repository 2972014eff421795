"""GGUF K-quants (Q4_K, Q5_K, Q6_K) run in their codes, on files made by
llama.cpp's own llama-quantize (tests/fixtures/gguf/, made by
scripts/make_kquant_fixtures.sh): Q4_K_M (Q4_K, with Q6_K for the LM head and
some of the layers, so that one fused q/k/v layer mixes Q4_K and Q6_K) and
Q5_K_M. The codes, scales and offsets Folio reads are the gguf package's
dequantization bit for bit; the packed form's float16 scales and offsets
are within half a float16 step of them (which moves the logits by up to
0.1 here); every linear layer, the embedding and the head are held
packed, none as floats; Folio's greedy tokens equal transformers' on the
weights as held, and its logits are within that float16 rounding of
transformers' on the gguf package's dequantized model."""

from pathlib import Path

import numpy as np
import pytest
import torch

from folio import LLM
from folio.model import gguf_blocks, gguf_loader
from folio.model.layers.quantization.int_groups import IntGroupsLinear
from tests.model.quantization.checkpoints import (FP32, assert_greedy_tokens_equal,
                                                  assert_logits_match, kernel_or_torch,
                                                  use_kernel)
from tests.utils import load_reference_model

FIXTURES = Path(__file__).parents[2] / "fixtures" / "gguf"
FILES = {"Q4_K_M": FIXTURES / "tiny-llama-Q4_K_M.gguf",
         "Q5_K_M": FIXTURES / "tiny-llama-Q5_K_M.gguf"}
PROMPTS = [[1, 20, 30, 40, 50, 60, 70, 80], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300]]


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf_loader.gguf_reader(str(path)).tensors}


def test_the_fixtures_are_what_llama_quantize_makes_of_each_kind():
    q4, q5 = _types(FILES["Q4_K_M"]), _types(FILES["Q5_K_M"])
    assert set(q4.values()) == {"Q4_K", "Q6_K", "F32"} and set(q5.values()) == {
        "Q5_K", "Q6_K", "F32"}
    # llama.cpp gives the head and some attn_v / ffn_down more bits
    assert q4["output.weight"] == "Q6_K" and "Q6_K" in {q4["blk.1.attn_v.weight"],
                                                        q4["blk.1.ffn_down.weight"]}


@pytest.mark.parametrize("kind", list(gguf_blocks.BLOCK_BYTES))
def test_every_packed_kind_splits_into_the_gguf_packages_values(kind):
    """Random blocks (valid float16 d): code * scale + offset, in fp32, equals
    gguf.quants.dequantize exactly, at the kind's own form and at a wider one."""
    import gguf
    size, per_block = gguf_blocks.BLOCK_BYTES[kind]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(3, 2, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2)}.get(kind, (0,))
    for at in halves:
        d = rng.normal(size=(3, 2)).astype(np.float16)
        blocks[..., at:at + 2] = np.ascontiguousarray(d).view(np.uint8).reshape(3, 2, 2)
    tensor = type("T", (), {"name": "t", "shape": (2 * per_block, 3),
                            "data": blocks.reshape(3, -1),
                            "tensor_type": gguf.GGMLQuantizationType[kind]})
    reference = gguf.quants.dequantize(blocks.reshape(3, -1), tensor.tensor_type)
    bits, group = gguf_loader.KINDS[kind]
    for form in ((bits, group), (8, 16)):
        parts = gguf_blocks.split_blocks(tensor, form)
        codes = parts["qcodes"]
        if form[0] == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
        groups = torch.arange(codes.shape[1]) // form[1]
        values = (codes.float() * parts["qscales"][:, groups] + parts["qoffsets"][:, groups])
        assert np.array_equal(values.numpy(), reference.reshape(3, -1)), form


@pytest.fixture(scope="module", params=list(FILES))
def loaded(request):
    path = str(FILES[request.param])
    return request.param, path, LLM(path, dtype="float32", **FP32, num_kv_blocks=32)


def test_every_linear_layer_is_held_in_its_codes(loaded):
    kind, path, llm = loaded
    model = llm.engine.executor.runner.model
    packed = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                       IntGroupsLinear)]
    # 2 layers x (qkv, o, gate_up, down), the embedding and the untied head
    assert len(packed) == 2 * 4 + 2
    assert not any(p.dtype.is_floating_point and p.dim() == 2 for p in model.parameters())
    # the held form against the file's values: a float16 scale and offset, each
    # within half a float16 step (2^-11) of the file's
    reader = gguf_loader.gguf_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = model.model.layers
    held = {"output.weight": model.lm_head, "blk.0.ffn_down.weight": layers[0].mlp.down_proj,
            "blk.1.ffn_down.weight": layers[1].mlp.down_proj,
            "blk.1.attn_output.weight": layers[1].self_attn.o_proj}
    for name, layer in held.items():
        t = tensors[name]
        parts = gguf_blocks.split_blocks(t, gguf_loader.KINDS[t.tensor_type.name])
        codes = parts["qcodes"]
        if gguf_loader.KINDS[t.tensor_type.name][0] == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
        groups = torch.arange(codes.shape[1]) // gguf_loader.KINDS[t.tensor_type.name][1]
        scaled, offset = codes.float() * parts["qscales"][:, groups], parts["qoffsets"][:, groups]
        error = (layer.quant_method.weights.dequantize() - (scaled + offset)).abs()
        assert (error <= 2 ** -11 * (scaled.abs() + offset.abs()) + 1e-30).all(), name
    qkv = layers[1].self_attn.qkv_proj.quant_method.weights
    if kind == "Q4_K_M":    # Q4_K q, k beside a Q6_K v: one form, 8 bits in groups of 16
        assert _types(path)["blk.1.attn_v.weight"] == "Q6_K" and qkv.bits == 8
        assert layers[0].self_attn.qkv_proj.quant_method.weights.bits == 4
        v = tensors["blk.1.attn_v.weight"]
        assert torch.allclose(qkv.dequantize()[-int(v.shape[1]):], gguf_blocks.dequantize(v),
                              rtol=2 ** -10, atol=2 ** -16)


def test_the_bytes_held_are_the_codes_and_a_float16_scale_and_offset_a_group(loaded):
    """Q4_K: 4 bits and 32 bits a group of 32 (5 a weight, the file's 4.5);
    Q5_K and Q6_K one byte a code (the file's 5.5 and 6.6 bits)."""
    kind, path, llm = loaded
    from folio.bench.weights import loaded_bytes
    held = loaded_bytes(llm.engine.executor.runner.model)["bytes"]
    file_bytes = Path(path).stat().st_size
    ratio = held["total"] / file_bytes
    assert ratio < (1.35 if kind == "Q4_K_M" else 1.7), ratio
    assert ratio > 1.0          # the float weights would be 4x and more


def _reference_as_held(path: str, model) -> torch.nn.Module:
    """transformers' model of the file with the weights Folio holds (their float16
    scales and offsets) in place of the file's exact values."""
    ref = load_reference_model(path, dtype=torch.float32)
    cfg = ref.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    held = {"model.embed_tokens.weight": model.model.embed_tokens.packed_table,
            "lm_head.weight": model.lm_head.quant_method.weights}
    for i, layer in enumerate(model.model.layers):
        qkv = layer.self_attn.qkv_proj.quant_method.weights.dequantize()
        gate_up = layer.mlp.gate_up_proj.quant_method.weights.dequantize()
        pre = f"model.layers.{i}."
        held.update({pre + "self_attn.q_proj.weight": qkv[:q],
                     pre + "self_attn.k_proj.weight": qkv[q:q + kv],
                     pre + "self_attn.v_proj.weight": qkv[q + kv:],
                     pre + "self_attn.o_proj.weight": layer.self_attn.o_proj.quant_method.weights,
                     pre + "mlp.gate_proj.weight": gate_up[:cfg.intermediate_size],
                     pre + "mlp.up_proj.weight": gate_up[cfg.intermediate_size:],
                     pre + "mlp.down_proj.weight": layer.mlp.down_proj.quant_method.weights})
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, w in held.items():
            params[name].copy_(w if isinstance(w, torch.Tensor) else w.dequantize())
    return ref


@kernel_or_torch
def test_greedy_tokens_are_transformers_on_the_weights_as_held(loaded, kernel, monkeypatch):
    """Exact execution: transformers on the dequantized held form gives Folio's
    tokens, and its logits to fp32 rounding."""
    _, path, llm = loaded
    use_kernel(kernel, monkeypatch)
    reference = _reference_as_held(path, llm.engine.executor.runner.model)
    assert_logits_match(llm, reference, PROMPTS, 2e-4)
    assert_greedy_tokens_equal(llm, reference, PROMPTS, Path(path).name)


def test_logits_are_within_the_float16_scales_of_the_files_values(loaded):
    """Against transformers on the gguf package's exact dequantization: the
    float16 scales and offsets move the logits (about 12 at most) by up to 0.1."""
    _, path, llm = loaded
    assert_logits_match(llm, load_reference_model(path, dtype=torch.float32), PROMPTS, 0.15)
