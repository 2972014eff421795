"""Make the quantized test checkpoints with the tools users make them with, and
transformers' reference logits for each (issue 16).

Run by scripts/make_quant_fixtures.sh inside a throwaway venv that holds
gptqmodel and optimum (they pin their own transformers; Folio's venv and
`make test` need neither). The tiny model is tests/utils.py's make_tiny_model
(2 layers, hidden 128, intermediate 256, 4 heads / 2 KV heads, vocab 384,
seed 0), so the float original can be rebuilt bit for bit.

    python scripts/make_quant_fixtures.py OUT_DIR

Writes OUT_DIR/<name>/ (the checkpoint as gptqmodel saves it) and, in each,
reference.safetensors: transformers' float32 logits for PROMPTS, loading that
same checkpoint (its GPTQ kernel on the CPU is gptqmodel's torch one).
OUT_DIR/README.md, which describes every folder, is kept by hand.
"""

import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.utils import make_tiny_model  # noqa: E402

SHAPE = dict(hidden_size=128, intermediate_size=256)
PROMPTS = [[1, 20, 30, 40, 50, 60, 70, 80], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300]]
# name -> QuantizeConfig arguments
VARIANTS = {
    "gptq-w4-g32-sym": dict(bits=4, group_size=32, sym=True, desc_act=False),
    "gptq-w4-g32-asym": dict(bits=4, group_size=32, sym=False, desc_act=False),
    "gptq-w4-g32-descact": dict(bits=4, group_size=32, sym=True, desc_act=True),
    "gptq-w8-g32-sym": dict(bits=8, group_size=32, sym=True, desc_act=False),
}


def calibration(n: int = 16, length: int = 64) -> list[dict]:
    rng = random.Random(0)
    return [{"input_ids": [rng.randrange(5, 380) for _ in range(length)],
             "attention_mask": [1] * length} for _ in range(n)]


def reference(folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu",
                                                 dtype=torch.float32).eval()
    tensors = {}
    with torch.no_grad():
        for i, ids in enumerate(PROMPTS):
            tensors[f"logits.{i}"] = model(torch.tensor([ids])).logits[0].float().contiguous()
            tensors[f"prompt.{i}"] = torch.tensor(ids)
    save_file(tensors, str(folder / "reference.safetensors"))


def main(out: Path) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_model(Path(tmp) / "float", **SHAPE)
        for name, args in VARIANTS.items():
            model = GPTQModel.load(source, QuantizeConfig(**args))
            model.quantize(calibration(), batch_size=1)
            target = out / name
            model.save(str(target))
            (target / "quant_log.csv").unlink(missing_ok=True)
            reference(target)
            print(f"{name}: {sum(f.stat().st_size for f in target.iterdir()) // 1024} KiB",
                  flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
