"""The quantized checkpoints made by real tools (tests/fixtures/quant, by
scripts/make_quant_fixtures.sh: gptqmodel 7.6.0; scripts/make_ct_fixtures.sh:
llm-compressor 0.14.0.1; the mixture-of-experts ones by
scripts/make_moe_quant_fixtures.sh, with both) and transformers' reference
logits for them are there, in the layout the formats' methods read (the
methods' own tests: tests/model/quantization/)."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
GPTQ = [n for n in NAMES if n.startswith("gptq-w")]


def test_the_fixtures_are_there():
    assert NAMES == ["awq-mixtral-w4-g32", "awq-w4-g32", "ct-fp8-block", "ct-fp8-dynamic",
                     "ct-fp8-static", "ct-qwen3moe-fp8-dynamic", "ct-qwen3moe-w4a16-g32",
                     "ct-w4a16-asym-g32", "ct-w4a16-g32", "ct-w8a16-channel",
                     "ct-w8a16-kv-fp8", "ct-w8a16-kv-fp8-head", "gptq-qwen3moe-w4-g32",
                     "gptq-w4-g32-asym", "gptq-w4-g32-descact", "gptq-w4-g32-sym",
                     "gptq-w8-g32-sym"]


@pytest.mark.parametrize("name", GPTQ)
def test_each_holds_gptq_tensors_and_reference_logits(name):
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["group_size"] == 32
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        qweight = f.get_slice("model.layers.0.mlp.down_proj.qweight")
        # GPTQ packs along the input axis: [in * bits / 32, out] int32
        assert qweight.get_dtype() == "I32"
        assert qweight.get_shape() == [256 * config["bits"] // 32, 128]
    with safe_open(str(folder / "reference.safetensors"), "pt") as f:
        logits, prompt = f.get_tensor("logits.0"), f.get_tensor("prompt.0")
        assert logits.shape == (len(prompt), 384) and logits.isfinite().all()
