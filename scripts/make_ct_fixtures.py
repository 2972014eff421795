"""Make the compressed-tensors test checkpoints with llm-compressor, and
transformers' reference logits for each (issue 16).

Run by scripts/make_ct_fixtures.sh inside a throwaway venv that holds
llmcompressor (it pins its own transformers and compressed-tensors). Same
tiny model, shapes, calibration data and prompts as make_quant_fixtures.py
(imported from it), so only the tool differs.

    python scripts/make_ct_fixtures.py OUT_DIR [NAME ...]   (default: every variant)

Writes OUT_DIR/<name>/ (the checkpoint as oneshot saves it with
save_compressed=True: format pack-quantized, float-quantized for the fp8
ones) and, in each, reference.safetensors: transformers' float32 logits for
the prompts, loading that same checkpoint (transformers decompresses
compressed-tensors itself, and quantizes the fp8 ones' activations as their
scheme says in the forward pass).
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_quant_fixtures import SHAPE, calibration, make_tiny_model, reference  # noqa: E402

# name -> the weights' QuantizationArgs (GPTQModifier, every Linear but lm_head)
VARIANTS = {
    "ct-w4a16-g32": dict(num_bits=4, type="int", symmetric=True, strategy="group",
                         group_size=32),
    "ct-w4a16-asym-g32": dict(num_bits=4, type="int", symmetric=False, strategy="group",
                              group_size=32),
    "ct-w8a16-channel": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
}
# name -> (weights, kv_cache_scheme): QuantizationModifier (round to nearest),
# the KV cache's static fp8 scales calibrated per layer (issue 32)
KV_VARIANTS = {
    "ct-w8a16-kv-fp8": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                        dict(num_bits=8, type="float", strategy="tensor", dynamic=False,
                             symmetric=True)),
    # a scale per KV head (compressed-tensors' attn_head strategy)
    "ct-w8a16-kv-fp8-head": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                             dict(num_bits=8, type="float", strategy="attn_head",
                                  dynamic=False, symmetric=True)),
}
# name -> (llm-compressor's preset, its scheme spelled out): QuantizationModifier,
# fp8 (e4m3) weights and activations (issue 54). The presets are
# compressed-tensors 0.19.0's (quantization/quant_scheme.py); main() checks that
# each spelled-out scheme equals its preset, and passes it as config_groups like
# the variants above rather than as scheme="..."
FP8_VARIANTS = {
    # a weight scale per output channel; each token's input scaled on the fly
    "ct-fp8-dynamic": ("FP8_DYNAMIC", dict(
        weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True,
                     dynamic=False),
        input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                               dynamic=True))),
    # one weight scale per tensor; one static input scale, calibrated
    "ct-fp8-static": ("FP8", dict(
        weights=dict(num_bits=8, type="float", strategy="tensor", symmetric=True,
                     dynamic=False),
        input_activations=dict(num_bits=8, type="float", strategy="tensor", symmetric=True,
                               dynamic=False, observer="static_minmax"))),
    # a weight scale per 128x128 block (DeepSeek-V3's); the inputs scaled on the
    # fly per token and group of 128
    "ct-fp8-block": ("FP8_BLOCK", dict(
        weights=dict(num_bits=8, type="float", strategy="block", symmetric=True,
                     dynamic=False, block_structure=[128, 128]),
        input_activations=dict(num_bits=8, type="float", strategy="group", symmetric=True,
                               dynamic=True, group_size=128))),
}


def fp8_scheme(preset: str, scheme: dict) -> dict:
    """`scheme` for config_groups, after checking that it is the preset."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
    assert QuantizationScheme(targets=["Linear"], **scheme) == \
        preset_name_to_scheme(preset, ["Linear"]), preset
    return scheme


def compress(source: str, recipe, target: Path) -> None:
    """oneshot `recipe` on the bfloat16 model at `source` (like the gptqmodel
    fixtures, and most real checkpoints), calibrated on `calibration()`,
    saved compressed to `target` with its reference logits."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer
    data = calibration()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    oneshot(model=model, tokenizer=AutoTokenizer.from_pretrained(source),
            dataset=Dataset.from_list(data), recipe=recipe,
            num_calibration_samples=len(data), max_seq_length=64,
            shuffle_calibration_samples=False, output_dir=str(target),
            save_compressed=True)
    reference(target)
    print(f"{target.name}: {sum(f.stat().st_size for f in target.iterdir()) // 1024} KiB",
          flush=True)


def main(out: Path, names: list[str]) -> None:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    out.mkdir(parents=True, exist_ok=True)
    # name -> (modifier, scheme, kv_cache_scheme)
    recipes = {name: (GPTQModifier, {"weights": weights}, None)
               for name, weights in VARIANTS.items()}
    recipes.update({name: (QuantizationModifier, {"weights": weights}, kv)
                    for name, (weights, kv) in KV_VARIANTS.items()})
    recipes.update({name: (QuantizationModifier, fp8_scheme(*preset), None)
                    for name, preset in FP8_VARIANTS.items()})
    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_model(Path(tmp) / "float", **SHAPE)
        for name, (modifier, scheme, kv) in recipes.items():
            if names and name not in names:
                continue
            extra = {"kv_cache_scheme": kv} if kv else {}
            recipe = modifier(
                config_groups={"group_0": {"targets": ["Linear"], **scheme}},
                ignore=["lm_head"], **extra)
            compress(source, recipe, out / name)

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
