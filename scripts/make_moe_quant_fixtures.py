"""Make quantized mixture-of-experts test checkpoints with the tools users make
them with, and transformers' reference logits for each (issue 29).

The tiny MoE models (tests/utils.py's make_tiny_model, seed 0): a Qwen3-MoE
and a Mixtral of hidden 128, 2 layers, 4 experts of 64 features, top 2, so
that every expert matrix is whole groups of 32 on one rank and on each of
two. Same calibration data and prompts as make_quant_fixtures.py.

    python scripts/make_moe_quant_fixtures.py OUT_DIR gptqmodel|llmcompressor [NAME ...]
        (default: every variant of that tool)

gptqmodel (in make_quant_fixtures.sh's venv): GPTQ on the Qwen3-MoE, AWQ on
the Mixtral; llmcompressor (in make_ct_fixtures.sh's venv): GPTQModifier,
compressed-tensors W4A16, and QuantizationModifier, FP8_DYNAMIC (issue 54), on
the Qwen3-MoE, the router left in float as llm-compressor's MoE examples do.
Run by scripts/make_moe_quant_fixtures.sh.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_quant_fixtures import calibration, make_tiny_model, reference  # noqa: E402

MOE = {
    "qwen3moe": dict(arch="qwen3_moe", hidden_size=128, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64, norm_topk_prob=True, head_dim=32),
    "mixtral": dict(arch="mixtral", hidden_size=128, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64),
}
# name -> (model, gptqmodel QuantizeConfig arguments)
GPTQMODEL = {
    "gptq-qwen3moe-w4-g32": ("qwen3moe", dict(bits=4, group_size=32, sym=True, desc_act=False)),
    "awq-mixtral-w4-g32": ("mixtral", dict(bits=4, group_size=32, sym=False, quant_method="awq",
                                           format="gemm")),
}
# name -> (model, the weights' QuantizationArgs)
LLMCOMPRESSOR = {
    "ct-qwen3moe-w4a16-g32": ("qwen3moe", dict(num_bits=4, type="int", symmetric=True,
                                               strategy="group", group_size=32)),
}
# name -> (model, the make_ct_fixtures.FP8_VARIANTS scheme): QuantizationModifier
LLMCOMPRESSOR_FP8 = {
    "ct-qwen3moe-fp8-dynamic": ("qwen3moe", "ct-fp8-dynamic"),
}


def _size(folder: Path) -> str:
    return f"{sum(f.stat().st_size for f in folder.iterdir()) // 1024} KiB"


def gptqmodel(out: Path, tmp: Path, names: list[str]) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    for name, (arch, args) in GPTQMODEL.items():
        if names and name not in names:
            continue
        source = make_tiny_model(tmp / arch, **MOE[arch])
        # no disk offload: its default path is a random temp dir written into
        # config.json
        model = GPTQModel.load(source, QuantizeConfig(**args, offload_to_disk=False))
        awq = args.get("quant_method") == "awq"
        model.quantize(calibration(), batch_size=1,
                       **({"backend": BACKEND.AWQ_TORCH} if awq else {}))
        target = out / name
        model.save(str(target))
        (target / "quant_log.csv").unlink(missing_ok=True)
        reference(target)
        print(f"{name}: {_size(target)}", flush=True)


def llmcompressor(out: Path, tmp: Path, names: list[str]) -> None:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from make_ct_fixtures import FP8_VARIANTS, compress, fp8_scheme
    # name -> (model, modifier, scheme)
    recipes = {name: (arch, GPTQModifier, {"weights": weights})
               for name, (arch, weights) in LLMCOMPRESSOR.items()}
    recipes.update({name: (arch, QuantizationModifier, fp8_scheme(*FP8_VARIANTS[dense]))
                    for name, (arch, dense) in LLMCOMPRESSOR_FP8.items()})
    for name, (arch, modifier, scheme) in recipes.items():
        if names and name not in names:
            continue
        recipe = modifier(config_groups={"group_0": {"targets": ["Linear"], **scheme}},
                          ignore=["lm_head", "re:.*mlp.gate$"])
        compress(make_tiny_model(tmp / arch, **MOE[arch]), recipe, out / name)

if __name__ == "__main__":
    out_dir, tool = Path(sys.argv[1]), sys.argv[2]
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        {"gptqmodel": gptqmodel, "llmcompressor": llmcompressor}[tool](out_dir, Path(scratch),
                                                                      sys.argv[3:])
