"""GGUF K-quants (Q4_K, Q5_K, Q6_K) run in their codes, on files made by
llama.cpp's own llama-quantize (tests/fixtures/gguf/, made by
scripts/make_kquant_fixtures.sh): Q4_K_M (Q4_K, with Q6_K for the LM head and
some of the layers, so that one fused q/k/v layer mixes Q4_K and Q6_K) and
Q5_K_M. The codes, scales and offsets Folio reads are the gguf package's
dequantization bit for bit, and so is the packed form (the sub-blocks'
integers as int8 under each super-block's float16 pair); every linear
layer, the embedding and the head are held packed, none as floats, a Q4_K_M
file within 10% of its size; Folio's greedy tokens equal transformers' on
the gguf package's dequantized model, and its logits are within fp32
rounding of them."""

from pathlib import Path

import numpy as np
import pytest
import torch

from folio import LLM
from folio.model import gguf_blocks, gguf_loader
from folio.model.layers.quantization.int_groups import IntGroupsLinear, RowParts
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
        # a K-quant's super-block pair, of which the scales and offsets are int8 multiples
        assert ("qsuperscales" in parts) == kind.endswith("_K")
        if kind.endswith("_K"):
            for value, mult in (("qscales", "qsuperscales"), ("qoffsets", "qsuperoffsets")):
                steps = parts[value] / parts[mult]
                assert torch.equal(steps.round() * parts[mult], parts[value]), (form, value)
                assert bool((steps.round().abs() <= 128).all())


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
    # the held form is the file's values, exactly
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
        held = layer.quant_method.weights
        assert torch.equal(held.dequantize(), scaled + offset), name
        assert torch.equal(held.dequantize(), gguf_blocks.dequantize(t)), name
        assert held.supers is not None and held.scales.dtype == torch.int8, name
        # Q6_K: one int8 a group serves the scale and the offset
        assert (held.offsets is None) == (t.tensor_type.name == "Q6_K"), name
    qkv = layers[1].self_attn.qkv_proj.quant_method.weights
    if kind == "Q4_K_M":    # Q4_K q, k beside a Q6_K v: each run in its own form
        assert _types(path)["blk.1.attn_v.weight"] == "Q6_K" and isinstance(qkv, RowParts)
        qk, v = qkv.parts
        assert (qk.bits, v.bits) == (4, 6) and qk.supers is not None and v.supers is not None
        assert int(qk.bounds[1]) == 32 and int(v.bounds[1]) == 16         # their groups
        assert layers[0].self_attn.qkv_proj.quant_method.weights.bits == 4
        cfg = llm.engine.config.model            # (llama.cpp's q/k rows, unpermuted)
        assert torch.equal(qk.dequantize(), torch.cat([gguf_loader._unpermute_rows(
            gguf_blocks.dequantize(tensors[f"blk.1.attn_{p}.weight"]), heads)
            for p, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads))]))
        assert torch.equal(v.dequantize(), gguf_blocks.dequantize(tensors["blk.1.attn_v.weight"]))


def test_the_bytes_held_are_about_the_files(loaded):
    """Q4_K: 4-bit codes, two int8s a group of 32 and a float16 pair a block
    of 256 (4.63 bits a weight, the file's 4.5); Q6_K: 6-bit codes, an int8 a
    group of 16 and the pair (6.63, the file's 6.56); Q5_K in the 6-bit form
    (6.63, the file's 5.5). Q4_K_M's fused q/k/v of Q4_K and Q6_K parts holds
    each run in its own form (it was one, 6 bits in groups of 16: 6% over the
    file); the sub-blocks' 6-bit scales as int8s are the 3% left."""
    kind, path, llm = loaded
    from folio.bench.weights import loaded_bytes
    held = loaded_bytes(llm.engine.executor.runner.model)["bytes"]
    file_bytes = Path(path).stat().st_size
    ratio = held["total"] / file_bytes
    assert ratio < (1.04 if kind == "Q4_K_M" else 1.2), ratio
    assert ratio > 1.0          # the float weights would be 4x and more


@kernel_or_torch
def test_logits_are_transformers_on_the_files_exact_values(loaded, kernel, monkeypatch):
    """Against transformers on the gguf package's dequantization of the file
    (the weights as held, exactly): logits to fp32 rounding, the same tokens."""
    _, path, llm = loaded
    use_kernel(kernel, monkeypatch)
    reference = load_reference_model(path, dtype=torch.float32)
    assert_logits_match(llm, reference, PROMPTS, 2e-4)
    assert_greedy_tokens_equal(llm, reference, PROMPTS, Path(path).name)


def test_a_moes_k_quant_experts_are_held_in_their_codes_exactly():
    """tests/fixtures/gguf/tiny-qwen3moe-Q4_K_M.gguf (llama-quantize's, by
    scripts/make_kquant_fixtures.sh): every expert's gate-and-up and down held
    in its codes under the file's two-level scales, their values the gguf
    package's dequantization exactly, no float expert held. Its attn_k and
    attn_v are Q8_0 (as llama.cpp makes 8-expert files), so the fused q/k/v
    mixes Q4_K with Q8_0: q held in 4 bits, k and v in 8, with float16 scales
    (a fused layer of a K-quant beside a legacy type loads no two-level ones). The tokens and
    logprobs are those of the same file read all dequantized (`-q none`),
    within the float16 rounding of that one layer's Q4_K scales (0.013 at
    most here, on logprobs of about -10)."""
    from folio import SamplingParams
    from folio.model.layers.moe import ExpertMatrix, FusedMoE
    path = str(FIXTURES / "tiny-qwen3moe-Q4_K_M.gguf")
    types = _types(path)
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in (0, 1) for p in
            ("gate", "up", "down")} <= {"Q4_K", "Q6_K"}
    llm = LLM(path, dtype="float32", **FP32, num_kv_blocks=32)
    tensors = {t.name: t for t in gguf_loader.gguf_reader(path).tensors}
    for i, layer in enumerate(llm.engine.executor.runner.model.model.layers):
        assert (types[f"blk.{i}.attn_q.weight"], types[f"blk.{i}.attn_k.weight"]) == (
            "Q4_K", "Q8_0")
        qkv = layer.self_attn.qkv_proj.quant_method.weights
        assert isinstance(qkv, RowParts)
        assert [(p.bits, p.supers) for p in qkv.parts] == [(4, None), (8, None)]
        assert torch.equal(qkv.parts[1].dequantize(), torch.cat([gguf_blocks.dequantize(
            tensors[f"blk.{i}.attn_{p}.weight"]) for p in ("k", "v")]))
        assert layer.self_attn.o_proj.quant_method.weights.supers is not None
        moe = layer.mlp
        assert isinstance(moe, FusedMoE)
        gate, up, down = (gguf_blocks.dequantize(tensors[f"blk.{i}.ffn_{p}_exps.weight"])
                          for p in ("gate", "up", "down"))          # [E, out, in]
        for e, (w13, w2) in enumerate(moe.packed_experts):
            assert isinstance(w13, ExpertMatrix) and isinstance(w2, ExpertMatrix)
            assert w13.weights.supers is not None and w2.weights.supers is not None
            assert torch.equal(w13.weights.dequantize(), torch.cat([gate[e], up[e]]))
            assert torch.equal(w2.weights.dequantize(), down[e])
        assert all(p.numel() == 0 for n, p in moe.named_parameters() if not n.startswith("gate"))
    floats = LLM(path, dtype="float32", **FP32, num_kv_blocks=32, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    for prompt in PROMPTS:
        a, b = (m.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                for m in (llm, floats))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys() and all(abs(pa[t] - pb[t]) < 0.05 for t in pa)
