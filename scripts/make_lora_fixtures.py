"""Make tests/fixtures/lora/smollm2-qv: a LoRA adapter of the default model
(SmolLM2-135M-Instruct), made by the real `peft` package (the dev extra's
pin) on the default model's float weights, as transformers dequantizes them
from its GGUF. Rank 2 on q_proj and v_proj of every layer, lora_alpha 4,
random (seed 0) with B scaled by 8 so that it changes the greedy answers as a
trained adapter would; stored in bf16 (230 KB) by peft's own save_pretrained
after a cast. tests/engine/test_lora_default_model.py holds Folio to
transformers + peft on it.

    .venv/bin/python scripts/make_lora_fixtures.py
"""

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.utils import default_gguf_path, load_reference_model  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "lora" / "smollm2-qv"


def main() -> None:
    torch.manual_seed(0)
    base = load_reference_model(default_gguf_path())
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data *= 8
    # the name a user's adapter would carry, not this machine's path
    model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.to(torch.bfloat16).save_pretrained(str(OUT))
    (OUT / "README.md").unlink()            # peft's empty model card
    for f in sorted(OUT.iterdir()):
        print(f, f.stat().st_size)


if __name__ == "__main__":
    main()
